"""The three workloads of benchmarks/speculative.py, as distinct prompts (seeded): no two
requests share a prompt, so a drafter that learns across requests (llama-server's ngram-cache,
ngram-mod) cannot be handed one request's answer by the one before.

- `edit`: a small Python module and the request to rename one identifier in it and give the
  whole file back: the answer repeats most of the prompt (what n-gram drafting is for);
- `summary`: a few paragraphs of plain prose to summarize: some copying of names and phrases;
- `free`: a short story from a one-line premise: nothing in the prompt to copy.

A chat model gets the task as a user message; a base model (a file without a chat template)
gets the same task framed as text for it to continue (the edited file's first fence opened).
"""

from __future__ import annotations

import random
from itertools import zip_longest

WORKLOADS = ("edit", "summary", "free", "mixed")  # mixed: edit and free by turns, in one batch

_NAMES = ("orders", "samples", "records", "events", "readings", "invoices", "tickets", "rows")
_FIELDS = ("price", "weight", "score", "amount", "latency", "count", "total", "size")
_CODE = '''import statistics
from dataclasses import dataclass


@dataclass
class {cls}:
    name: str
    {field}: float
    tags: list[str]


def load_{items}(path: str) -> list[{cls}]:
    """Reads one {item} a line: name, {field}, then tags separated by commas."""
    {items} = []
    with open(path) as handle:
        for line in handle:
            name, value, *tags = line.strip().split(",")
            {items}.append({cls}(name, float(value), tags))
    return {items}


def mean_{field}({items}: list[{cls}]) -> float:
    return statistics.fmean(entry.{field} for entry in {items})


def above(threshold: float, {items}: list[{cls}]) -> list[str]:
    """Names of the {items} whose {field} is above `threshold`, sorted."""
    return sorted(entry.name for entry in {items} if entry.{field} > threshold)


def tagged(tag: str, {items}: list[{cls}]) -> list[{cls}]:
    return [entry for entry in {items} if tag in entry.tags]


def report({items}: list[{cls}]) -> str:
    lines = [f"{{len({items})}} {items}, mean {field} {{mean_{field}({items}):.2f}}"]
    for entry in sorted({items}, key=lambda e: e.{field}, reverse=True)[:{top}]:
        lines.append(f"  {{entry.name}}: {{entry.{field}:.2f}}")
    return "\\n".join(lines)
'''
_PEOPLE = ("Ada", "Bram", "Chiara", "Dmitri", "Esme", "Farid", "Greta", "Hiro", "Ines", "Jonah")
_TOWNS = ("Larkfield", "Owlbridge", "Marrow Bay", "Stonemere", "Fenwick", "Ashgrove")
_SENTENCES = (
    "{a} opened the bakery on the corner of {town}'s market square in the spring.",
    "The town council of {town} argued for months about whether to rebuild the old bridge.",
    "{b}, who had run the ferry for twenty years, said the river had never been so low.",
    "Most of the money for the new library came from a fund that {a} had set up years earlier.",
    "When the factory closed, nearly a third of {town}'s families lost their main income.",
    "{b} organised a weekly market where farmers from the valley could sell directly.",
    "The school added evening classes in carpentry and accounting for adults.",
    "Visitors started to come for the autumn festival, and the two inns were full by October.",
    "{a} warned that the harbour wall would not survive another winter of storms.",
    "In the end the council voted to repair the bridge and to widen the road to the station.",
    "The railway company promised two more trains a day if the station was modernised.",
    "{b}'s daughter returned from the city to take over the ferry and to run boat tours.",
)
_CREATURES = ("lighthouse keeper", "clockmaker", "fox", "retired astronaut", "beekeeper")
_PREMISES = (
    "finds a letter that was never delivered",
    "has to cross a frozen lake before nightfall",
    "wakes up to find every clock in town has stopped",
    "is asked to guard a seed that might grow into anything",
    "hears music coming from an empty house",
)


def _edit(rng: random.Random) -> tuple[str, str]:
    """(task for a chat model, text for a base model to continue)."""
    items = rng.choice(_NAMES)
    fields = dict(
        items=items,
        item=items.removesuffix("s"),
        cls=items.removesuffix("s").capitalize(),
        field=rng.choice(_FIELDS),
        top=rng.randint(3, 9),
    )
    code = _CODE.format(**fields)
    old, new = fields["field"], rng.choice([f for f in _FIELDS if f != fields["field"]])
    task = (
        f"Rename the field `{old}` to `{new}` everywhere in this Python module, including the "
        f"function names that contain it. Reply with the complete modified module only.\n\n"
        f"```python\n{code}```"
    )
    base = (
        f"# before.py\n```python\n{code}```\n\n# after.py: the same module with the field "
        f"`{old}` renamed to `{new}` everywhere\n```python\n"
    )
    return task, base


def _summary(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(_PEOPLE, 2)
    town = rng.choice(_TOWNS)
    sentences = [s.format(a=a, b=b, town=town) for s in _SENTENCES]
    rng.shuffle(sentences)
    text = "\n\n".join(" ".join(sentences[i : i + 3]) for i in range(0, len(sentences), 3))
    task = f"Summarize the following text in a few sentences.\n\n{text}"
    return task, f"{text}\n\nSummary of the text above:"


def _free(rng: random.Random) -> tuple[str, str]:
    who, what, where = rng.choice(_CREATURES), rng.choice(_PREMISES), rng.choice(_TOWNS)
    task = f"Write a short story about a {who} in {where} who {what}."
    return task, f"A short story about a {who} in {where} who {what}.\n\n"


_BUILDERS = {"edit": _edit, "summary": _summary, "free": _free}


def workload_prompts(workload: str, count: int, chat: bool, seed: int) -> list[str]:
    """`count` distinct prompts of `workload` (chat: user messages; else base-model text)."""
    if workload == "mixed":  # by turns, so concurrent streams hold both kinds
        edit = workload_prompts("edit", (count + 1) // 2, chat, seed)
        free = workload_prompts("free", count // 2, chat, seed)
        return [p for pair in zip_longest(edit, free) for p in pair if p is not None]
    rng = random.Random(f"{workload}-{seed}")
    prompts: list[str] = []
    for _ in range(count * 50):  # the combinations are many; distinct ones come quickly
        task, base = _BUILDERS[workload](rng)
        prompt = task if chat else base
        if prompt not in prompts:
            prompts.append(prompt)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"fewer than {count} distinct {workload} prompts")
