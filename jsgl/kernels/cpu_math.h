// Vector math shared by the CPU kernels.
#pragma once

#include <initializer_list>

#include "cpu_simd.h"

namespace jsgl {

// e^x for x in [-87, 88] (clamped), within ~2 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its
// degree-6 Taylor polynomial, times 2^n.
inline Vec Exp(Vec x) {
  x = Min(Max(x, Set1(-87.f)), Set1(88.f));
  const Vec n = RoundNearest(Mul(x, Set1(1.44269504f)));
  Vec r = Fnmadd(n, Set1(0.693145751953125f), x);  // ln2 in two parts
  r = Fnmadd(n, Set1(1.428606765330187e-6f), r);
  Vec p = Set1(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = Fmadd(p, r, Set1(c));
  return Scale2(p, n);
}

}  // namespace jsgl
