"""Agent workloads (paper Fig. 5, "ReAct Agents" and "Generative Agents"). The paper replays recorded
traces of both: each call's prompt is rebuilt from the trace, so what a system computes does not depend on
what its model generates. We have no such traces, so these programs build **synthetic trace-shaped**
inputs with the same call structure:

- ReAct: a fixed instruction + exemplar header, a question, then per step a generated "thought/action"
  in a scratch branch (as the replay does) followed by the trace's recorded thought, action and
  observation. Questions are BoolQ's; observations are BM25 search results over BoolQ's passages.
- Generative agents: per agent, a persona summary shared by every call; per event three calls on it in
  sequence, each depending on the last (poignancy 1-10, an event triple, the sector the agent goes to).
"""

from __future__ import annotations

import random
from typing import Any

from jsgl.experiments.datasets import boolq_rows
from jsgl.experiments.workloads import Workload, register
from jsgl.experiments.workloads.retrieval import boolq_retriever

import jsgl.lang as sgl

REACT_STEPS = 3
REACT_HEADER = (
    "Solve a question answering task with interleaving Thought, Action, Observation steps. Thought can "
    "reason about the current situation, and Action can be three types:\n"
    "(1) Search[entity], which searches the exact entity on Wikipedia and returns the first paragraph if it "
    "exists. If not, it will return some similar entities to search.\n"
    "(2) Lookup[keyword], which returns the next sentence containing keyword in the current passage.\n"
    "(3) Finish[answer], which returns the answer and finishes the task.\n"
    "Here are some examples.\n"
    "Question: Is the Eiffel Tower taller than the Statue of Liberty?\n"
    "Thought 1: I need to search the Eiffel Tower and find its height.\n"
    "Action 1: Search[Eiffel Tower]\n"
    "Observation 1: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is 330 metres tall.\n"
    "Thought 2: The Eiffel Tower is 330 metres tall. I need to search the Statue of Liberty next.\n"
    "Action 2: Search[Statue of Liberty]\n"
    "Observation 2: The Statue of Liberty is a colossal neoclassical sculpture on Liberty Island in New York "
    "Harbor. Its height from ground to torch is 93 metres.\n"
    "Thought 3: 330 metres is more than 93 metres, so the answer is yes.\n"
    "Action 3: Finish[yes]\n"
)


@sgl.function
def react_agent(s, question: str, trace: list[tuple[str, str, str]]):
    s += REACT_HEADER + f"Question: {question}?\n"
    for i, (thought, action, observation) in enumerate(trace, 1):
        s += f"Thought {i}:"
        with s.copy() as scratch:  # generated, then replaced by the recorded step (as the replay does)
            scratch += sgl.gen(f"step_{i}", max_tokens=24, stop="Observation")
        s += f" {thought}\nAction {i}: {action}\nObservation {i}: {observation}\n"
    s += f"Thought {len(trace) + 1}:" + sgl.gen("final", max_tokens=24, stop="Observation")


def react_inputs(n: int) -> list[dict[str, Any]]:
    retriever = boolq_retriever()
    out = []
    for row in boolq_rows()[100: 100 + n]:
        question = row["question"]
        found = retriever.search(question, REACT_STEPS)
        trace = []
        for i, passage in enumerate(found):
            entity = " ".join(passage.split(" (")[0].split()[:4]).strip(".,;")
            thought = f"I need to search {entity} to answer the question." if i == 0 else \
                f"That is not enough. I need to search {entity} instead."
            trace.append((thought, f"Search[{entity}]", passage))
        out.append({"question": question, "trace": trace})
    return out


_NAMES = ["Isabella Rodriguez", "Klaus Mueller", "Maria Lopez", "Sam Moore", "Jennifer Moore", "Tom Moreno",
          "Yuriko Yamamoto", "Carmen Ortiz", "Eddy Lin", "John Lin", "Mei Lin", "Adam Smith", "Abigail Chen",
          "Rajiv Patel", "Latoya Williams", "Hailey Johnson", "Arthur Burton", "Ryan Park", "Giorgio Rossi",
          "Carlos Gomez", "Francisco Lopez", "Ayesha Khan", "Wolfgang Schulz", "Jane Moreno", "Tamara Taylor"]
_JOBS = ["cafe owner", "college student", "pharmacy shopkeeper", "poet", "painter", "musician", "tax lawyer",
         "bar owner", "philosophy professor", "researcher", "mathematician", "retired teacher"]
_TRAITS = ["friendly", "outgoing", "hospitable", "kind", "curious", "organized", "shy", "ambitious",
           "hardworking", "creative", "patient", "passionate", "thoughtful", "cheerful"]
_PLACES = ["Hobbs Cafe", "Oak Hill College", "The Willows Market and Pharmacy", "The Rose and Crown Pub",
           "Johnson Park", "Harvey Oak Supply Store", "Town Hall", "the library", "their home"]
_ACTIVITIES = ["having breakfast", "opening the shop", "writing a poem", "planning a party", "reading a book",
               "talking with a neighbour", "studying for an exam", "cleaning the kitchen", "taking a walk",
               "painting a landscape", "practicing the guitar", "buying groceries", "preparing a lecture"]


def persona(rng: random.Random, name: str) -> str:
    traits = ", ".join(rng.sample(_TRAITS, 3))
    job, home = rng.choice(_JOBS), rng.choice(_PLACES[:6])
    return (f"Name: {name} (age: {rng.randint(19, 70)})\nInnate traits: {traits}\n"
            f"Learned traits: {name} is a {job} who loves to make people feel welcome. {name} spends most "
            f"days near {home} and knows most of the town's residents by name.\n"
            f"Currently: {name} is planning the week and wants to get to know the new neighbours.\n"
            f"Lifestyle: {name} goes to bed around 11pm, wakes up around 6am and eats dinner around 6pm.\n"
            f"Daily plan requirement: {name} works in the morning and meets friends in the evening.\n")


@sgl.function
def generative_agent(s, profile: str, name: str, events: list[str]):
    s += profile
    for i, event in enumerate(events):
        with s.copy() as call:
            call += (f"\nOn the scale of 1 to 10, where 1 is purely mundane and 10 is extremely poignant, rate "
                     f"the likely poignancy of the following event for {name}.\nEvent: {event}\nRate: ")
            call += sgl.gen(f"poignancy_{i}", max_tokens=2, regex=r"(10|[1-9])")
        with s.copy() as call:
            call += f"\nTask: turn the input into (subject, predicate, object).\nInput: {event}\nOutput: ("
            call += sgl.gen(f"triple_{i}", max_tokens=16, stop=")")
        with s.copy() as call:
            call += (f"\n{name} is {event.split(' is ', 1)[1]}. Which area should {name} go to? "
                     f"Answer with one of: {', '.join(_PLACES)}.\nArea:")
            call += sgl.select(f"sector_{i}", choices=[" " + p for p in _PLACES])


def generative_agent_inputs(n: int, events_per_agent: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        name = _NAMES[i % len(_NAMES)]
        events = [f"{name} is {rng.choice(_ACTIVITIES)}" for _ in range(events_per_agent)]
        out.append({"profile": persona(rng, name), "name": name, "events": events})
    return out


register(Workload(
    name="react", title="ReAct agents",
    source="synthetic trace-shaped: BoolQ questions, BM25 observations over BoolQ's passages",
    program=react_agent, inputs=react_inputs, outputs=("step_1", "final"), programs=32, quick_programs=4,
    note="the paper replays recorded HotpotQA ReAct traces; these are built from BoolQ (no traces ship)"))
register(Workload(
    name="generative_agents", title="Generative agents",
    source="synthetic trace-shaped: template personas of Smallville's residents, 3 events x 3 calls each",
    program=generative_agent, inputs=generative_agent_inputs, outputs=("poignancy_0", "triple_0", "sector_0"),
    programs=24, quick_programs=4,
    note="the paper replays recorded calls of the Generative Agents simulation; these follow its call types"))
