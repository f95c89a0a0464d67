"""Prompt sets for the CPU benches: Spec-Bench (per category, first turn) and a code-editing set.

* ``spec_bench(per_category, categories)``: the first ``per_category`` questions of each
  Spec-Bench category (file order, so the sample is deterministic), first turn only, as
  ``Prompt(category, qid, messages)``. The file is ``benches/data/spec_bench/question.jsonl``
  (a copy of Spec-Bench's, Apache-2.0; see its README) unless ``TOKENBUDGET_SPEC_BENCH`` points
  elsewhere.
* ``code_editing(n)``: 12 "Rewrite the following function so that <change>" prompts over
  realistic 10-30 line functions. This is the workload where prompt lookup shines: most of the
  answer is a copy of the prompt.
* ``chat_token_ids(tokenizer, prompt, max_prompt_tokens)``: chat-templated token ids; prompts
  longer than the cap keep their first ``max_prompt_tokens`` tokens of the user message
  (the template around it is kept), so the answer still follows the question.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SPEC_BENCH = os.environ.get("TOKENBUDGET_SPEC_BENCH",
                            os.path.join(os.path.dirname(__file__), "data", "spec_bench", "question.jsonl"))
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                         "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True, slots=True)
class Prompt:
    category: str
    qid: str
    text: str  # the user message (first turn)


def spec_bench(per_category: int = 4, categories: tuple[str, ...] | None = None,
               path: str = SPEC_BENCH) -> list[Prompt]:
    want = tuple(categories) if categories else SPEC_BENCH_CATEGORIES
    counts = {c: 0 for c in want}
    out: list[Prompt] = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            c = q["category"]
            if c in counts and counts[c] < per_category:
                counts[c] += 1
                out.append(Prompt(c, str(q["question_id"]), q["turns"][0]))
    order = {c: i for i, c in enumerate(want)}
    return sorted(out, key=lambda p: order[p.category])


def chat_token_ids(tokenizer, text: str, max_prompt_tokens: int = 1500) -> list[int]:
    """Chat-templated ids of a one-turn conversation; the user text is cut to fit the cap."""
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    if len(ids) <= max_prompt_tokens:
        return ids
    overhead = len(ids) - len(tokenizer.encode(text))
    body = tokenizer.encode(text)[:max(1, max_prompt_tokens - overhead)]
    cut = tokenizer.decode(body)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": cut}]))
    return ids[:max_prompt_tokens] if len(ids) > max_prompt_tokens else ids


# ------------------------------------------------------------------------------ code editing
_FUNCS: list[tuple[str, str]] = [
    ("it also accepts lines with surrounding whitespace and ignores comment lines starting with '#'",
     '''def parse_config(text):
    """Parse 'key = value' lines into a dict."""
    result = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line:
            continue
        if "=" not in line:
            raise ValueError(f"line {lineno}: expected key = value")
        key, value = line.split("=", 1)
        key = key.strip()
        value = value.strip()
        if value.isdigit():
            value = int(value)
        elif value.lower() in ("true", "false"):
            value = value.lower() == "true"
        result[key] = value
    return result'''),
    ("it sorts in descending order instead of ascending",
     '''def insertion_sort(items):
    """Sort a list in place with insertion sort and return it."""
    for i in range(1, len(items)):
        current = items[i]
        j = i - 1
        while j >= 0 and items[j] > current:
            items[j + 1] = items[j]
            j -= 1
        items[j + 1] = current
    return items'''),
    ("withdraw raises a custom InsufficientFunds exception instead of ValueError",
     '''class BankAccount:
    def __init__(self, owner, balance=0.0):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount
        self.history.append(("deposit", amount))
        return self.balance

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(("withdraw", amount))
        return self.balance'''),
    ("it uses a binary search on the sorted list instead of a linear scan",
     '''def find_index(sorted_values, target):
    """Return the index of target in sorted_values, or -1 if it is absent."""
    for index, value in enumerate(sorted_values):
        if value == target:
            return index
        if value > target:
            break
    return -1


def count_between(sorted_values, low, high):
    """Count values v with low <= v <= high."""
    count = 0
    for value in sorted_values:
        if low <= value <= high:
            count += 1
    return count'''),
    ("it returns the results as a list of dictionaries with the keys 'name', 'age' and 'email'",
     '''import csv


def read_users(path):
    """Read a CSV file of users and return (name, age, email) tuples."""
    users = []
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader)
        for row in reader:
            if len(row) != len(header):
                continue
            name = row[0].strip()
            age = int(row[1])
            email = row[2].strip().lower()
            if "@" not in email:
                continue
            users.append((name, age, email))
    return users'''),
    ("it also counts words case-insensitively and ignores punctuation",
     '''def word_frequencies(text, top_n=10):
    """Return the top_n most frequent words with their counts."""
    counts = {}
    for word in text.split():
        if word in counts:
            counts[word] += 1
        else:
            counts[word] = 1
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    return ranked[:top_n]'''),
    ("the cache evicts the least recently used entry when it holds more than capacity items",
     '''class Cache:
    def __init__(self, capacity=128):
        self.capacity = capacity
        self.data = {}
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        if key in self.data:
            self.hits += 1
            return self.data[key]
        self.misses += 1
        return default

    def put(self, key, value):
        self.data[key] = value

    def stats(self):
        total = self.hits + self.misses
        rate = self.hits / total if total else 0.0
        return {"hits": self.hits, "misses": self.misses, "hit_rate": rate}'''),
    ("it merges overlapping intervals and also intervals that merely touch (end == start)",
     '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start < last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged'''),
    ("it retries up to max_retries times with exponential backoff on ConnectionError",
     '''import json
import urllib.request


def fetch_json(url, timeout=10):
    """Download url and decode its JSON body."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status != 200:
            raise RuntimeError(f"unexpected status {response.status}")
        body = response.read().decode("utf-8")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data'''),
    ("it validates that the matrices have compatible shapes and raises ValueError otherwise",
     '''def matmul(a, b):
    """Multiply two matrices given as lists of rows."""
    rows = len(a)
    cols = len(b[0])
    inner = len(b)
    result = [[0.0] * cols for _ in range(rows)]
    for i in range(rows):
        for j in range(cols):
            total = 0.0
            for k in range(inner):
                total += a[i][k] * b[k][j]
            result[i][j] = total
    return result


def transpose(m):
    return [list(row) for row in zip(*m)]'''),
    ("it uses a dataclass for Task and sorts tasks by priority, then by due date",
     '''class Task:
    def __init__(self, title, priority, due):
        self.title = title
        self.priority = priority
        self.due = due
        self.done = False


class TodoList:
    def __init__(self):
        self.tasks = []

    def add(self, title, priority=3, due=None):
        task = Task(title, priority, due)
        self.tasks.append(task)
        return task

    def complete(self, title):
        for task in self.tasks:
            if task.title == title:
                task.done = True
                return True
        return False

    def pending(self):
        return [task for task in self.tasks if not task.done]'''),
    ("it accepts dates in both 'YYYY-MM-DD' and 'DD/MM/YYYY' formats",
     '''from datetime import date


def parse_date(text):
    """Parse a 'YYYY-MM-DD' string into a date."""
    parts = text.strip().split("-")
    if len(parts) != 3:
        raise ValueError(f"bad date: {text!r}")
    year, month, day = (int(p) for p in parts)
    return date(year, month, day)


def days_between(first, second):
    """Number of days from first to second, both given as strings."""
    start = parse_date(first)
    end = parse_date(second)
    return (end - start).days'''),
]


def code_editing(n: int | None = None) -> list[Prompt]:
    """The code-editing set (12 prompts); ``n`` keeps the first n."""
    out = [Prompt("code_editing", f"edit-{i}",
                  f"Rewrite the following function so that {change}:\n```python\n{code}\n```")
           for i, (change, code) in enumerate(_FUNCS)]
    return out[:n] if n is not None else out


def bench_prompts(per_category: int = 4, categories: tuple[str, ...] | None = None,
                  with_code_editing: bool = True) -> list[Prompt]:
    """Spec-Bench sample plus (optionally) ``per_category`` code-editing prompts."""
    cats = tuple(c for c in (categories or SPEC_BENCH_CATEGORIES) if c != "code_editing")
    out = spec_bench(per_category, cats) if cats else []
    if with_code_editing and (categories is None or "code_editing" in categories):
        out += code_editing(per_category)
    return out


if __name__ == "__main__":
    import collections

    ps = bench_prompts(4)
    print(collections.Counter(p.category for p in ps))
    print(code_editing(1)[0].text)
