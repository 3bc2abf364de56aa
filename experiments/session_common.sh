# Shared by the prepared device scripts (gpu_session.sh, tpu_session.sh): `source` it with the log's name.
# Sends everything to $OUT/NAME.log (./out without $OUT) and defines `part`, one timed part of a session.
OUT="${OUT:-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/$1.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
status=0
part() {  # part SECONDS TITLE COMMAND...: one timed part; a failure is reported and the next part still runs
    local limit="$1" title="$2" start=$SECONDS rc=0
    shift 2
    echo "===== $title (limit ${limit} s)"
    timeout "$limit" "$@" || rc=$?
    echo "===== $title: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
