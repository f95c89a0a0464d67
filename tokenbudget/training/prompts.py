"""Training prompts with no dataset: the target writes them, or they come from installed text.

Issue 27's data rule: nothing downloaded, nothing from the evaluation prompt sets (the benches'
workloads). Three sources, each tagged with its task kind so acceptance can be read per kind:

- *self-written*: the target is asked, at temperature, for a question or instruction of a task
  kind about a topic (``meta_prompts`` -> ``LLM.generate`` -> ``clean_written``);
- *templates*: task kinds x topics (chat, explanation, writing and role play, code, math with
  random numbers);
- *package text*: docstrings and small function sources of the Python standard library on this
  machine, as material to summarize, rewrite, translate or explain.

Everything is drawn from one seeded ``random.Random``, so a rerun writes the same prompts.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "climate change", "the human heart",
    "vaccines", "sleep", "nutrition", "exercise", "meditation", "the Roman Empire", "ancient Egypt",
    "the French Revolution", "World War II", "the printing press", "the internet", "smartphones",
    "artificial intelligence", "machine learning", "databases", "operating systems", "cryptography",
    "renewable energy", "solar panels", "electric cars", "recycling", "ocean tides", "earthquakes",
    "the solar system", "Mars", "the moon", "stars", "DNA", "evolution", "bees", "dogs", "cats",
    "gardening", "cooking pasta", "baking bread", "coffee", "tea", "chocolate", "budgeting",
    "saving money", "investing", "inflation", "taxes", "job interviews", "writing a resume",
    "public speaking", "learning a language", "studying for exams", "time management", "friendship",
    "travel in Japan", "visiting Paris", "camping", "hiking", "photography", "painting", "music theory",
    "playing guitar", "chess", "football", "basketball", "the Olympics", "movies", "novels", "poetry",
    "Shakespeare", "philosophy", "democracy", "economics", "supply and demand", "geometry", "fractions",
    "probability", "statistics", "algebra", "prime numbers", "Python programming", "JavaScript",
    "sorting algorithms", "recursion", "web development", "Git", "Linux", "email etiquette",
    "customer service", "marketing", "starting a small business", "first aid", "stress", "happiness",
    "rain forests", "deserts", "mountains", "rivers", "birds", "whales", "dinosaurs", "electricity",
    "magnets", "light", "sound", "gravity", "atoms", "chemistry in the kitchen", "weather forecasts",
    "a rainy afternoon", "moving to a new city", "a family reunion", "a birthday party", "a wedding",
    "the first day at a new job", "a road trip", "a lost wallet", "a small bakery", "a local library",
    "a mountain village", "a busy airport", "a science fair", "a volunteer project", "a neighborhood park",
    "online shopping", "social media", "video games", "board games", "remote work", "city traffic",
    "public transport", "urban gardening", "minimalism", "fashion", "architecture", "museums", "theater",
    "jazz", "classical music", "podcasts", "journalism", "advertising", "negotiation", "leadership",
    "teamwork", "parenting", "pets", "houseplants", "home repairs", "cleaning", "sustainable living",
    "ocean pollution", "wildfires", "space travel", "robots", "self-driving cars", "virtual reality",
    "medieval castles", "pirates", "the Silk Road", "the Renaissance", "the Industrial Revolution",
)

KINDS = ("chat", "explanation", "writing", "code", "summary", "math", "rewrite", "translation")

_CHAT = ("What is {t}?", "Can you tell me about {t}?", "Give me three tips about {t}.",
         "What are the most interesting facts about {t}?", "I want to learn about {t}. Where should I start?",
         "What are common mistakes people make with {t}?", "Write a short story involving {t}.",
         "What are the pros and cons of {t}?", "Write a short poem about {t}.")
_WRITING = ("Write a blog post about {t}.", "Write an email to a friend about {t}.",
            "Write a short speech about {t} for a school event.", "Write a persuasive paragraph about {t}.",
            "Write a dialogue between two friends talking about {t}.", "Write a letter to your future self about {t}.",
            "Write a diary entry about {t}.", "Write a short news report about {t}.",
            "Pretend you are an expert on {t}. In that role, tell a newcomer what matters most.",
            "Imagine you are a tour guide. Describe {t} to your group.",
            "Act as a teacher and give a short lesson on {t}.",
            "You are a character in a novel who loves {t}. Introduce yourself.")
_EXPLAIN = ("Explain {t} to a beginner.", "Explain {t} in simple terms.", "Why is {t} important?",
            "How does {t} work?", "Describe the history of {t} briefly.", "Explain {t} to a ten-year-old.")
_CODE_TASKS = ("reverse a string", "check whether a number is prime", "count the vowels in a string",
               "return the largest element of a list", "compute the factorial of n", "merge two sorted lists",
               "remove duplicates from a list", "check whether a string is a palindrome",
               "compute the n-th Fibonacci number", "sum the digits of an integer", "flatten a nested list",
               "count word frequencies in a text", "convert Celsius to Fahrenheit", "find the median of a list",
               "validate an email address", "read a CSV file and print each row",
               "sort a list of dictionaries by a key",
               "compute the greatest common divisor of two numbers", "find all even numbers in a list",
               "capitalize the first letter of each word")
_CODE = ("Write a Python function to {c}.", "Write a JavaScript function that can {c}.",
         "How do I {c} in Python?", "Show me how to {c} in C.", "Write a short program to {c}, with comments.")
_WRITE_META = {
    "chat": "Write one question that a curious person might ask a helpful assistant about {t}. "
            "Reply with the question only.",
    "explanation": "Write one request asking an assistant to explain something about {t}. Reply with the request only.",
    "writing": "Write one request asking an assistant to write a story, letter, blog post or speech, or to play a "
               "character, connected with {t}. Reply with the request only.",
    "code": "Write one programming task related to {t} that a student could solve in Python. "
            "Reply with the task only.",
    "math": "Write one short math word problem about {t}. Reply with the problem only.",
    "rewrite": "Write one sentence about {t}.",
    "translation": "Write one simple sentence about {t}.",
    "summary": "Write a short paragraph about {t}.",
}


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    return rng.choice((
        f"What is {a} * {b}?", f"What is {a} + {b} - {c}?", f"Solve for x: {c}x + {a} = {a + c * b}.",
        f"A shop sells pens for ${c} each. How much do {a} pens cost?",
        f"A train travels at {a} km/h for {c} hours. How far does it travel?",
        f"What is {c}/{c + 1} as a decimal and as a percentage?", f"Is {a * b + 1} a prime number? Explain.",
        f"What is the area of a rectangle that is {a} cm long and {b} cm wide?",
        f"If I have {a} apples and give away {min(a, b)}, how many are left?",
        f"What is {a}% of {b * 10}?"))


def package_texts(limit: int = 400) -> tuple[list[str], list[str]]:
    """(prose paragraphs, small function sources) from the standard library installed here."""
    prose, code = [], []
    names = ("json", "argparse", "collections", "functools", "itertools", "textwrap", "string", "random",
             "statistics", "fractions", "decimal", "datetime", "calendar", "pathlib", "shutil", "csv",
             "heapq", "bisect", "difflib", "logging", "unittest", "email", "http.client", "urllib.parse",
             "html", "zipfile", "tarfile", "gzip", "sqlite3", "threading", "queue", "subprocess", "socket",
             "inspect", "dataclasses", "enum", "pprint", "copy", "pickle", "base64", "hashlib",
             "secrets", "uuid", "ipaddress", "tempfile", "glob", "fnmatch", "configparser", "getopt", "optparse",
             "locale", "gettext", "doctest", "timeit", "trace", "pdb", "cmd", "shlex", "weakref", "abc", "numbers")
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(mod) or ""]
        for _, obj in inspect.getmembers(mod):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                docs.append(inspect.getdoc(obj) or "")
                if inspect.isfunction(obj):
                    try:
                        src = inspect.getsource(obj)
                    except (OSError, TypeError):
                        src = ""
                    if 4 <= src.count("\n") <= 25 and len(src) < 900:
                        code.append(src.rstrip())
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                para = " ".join(para.split())
                if 200 <= len(para) <= 900 and para.count(">>>") == 0:
                    prose.append(para)
    return sorted(set(prose))[:limit * 4], sorted(set(code))[:limit * 4]


def _sentences(prose: list[str]) -> list[str]:
    out = []
    for p in prose:
        out += [s.strip() for s in re.split(r"(?<=[.!?])\s+", p) if 40 <= len(s.strip()) <= 200]
    return out


def template_prompts(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """``n`` (kind, prompt) pairs from templates and package text, kinds in rotation."""
    prose, code = package_texts()
    sentences = _sentences(prose)
    languages = ("French", "Spanish", "German", "Italian", "Portuguese")
    out: list[tuple[str, str]] = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        t = rng.choice(TOPICS)
        if kind == "chat":
            p = rng.choice(_CHAT).format(t=t)
        elif kind == "explanation":
            p = rng.choice(_EXPLAIN).format(t=t)
        elif kind == "writing":
            p = rng.choice(_WRITING).format(t=t)
        elif kind == "code":
            p = (rng.choice(_CODE).format(c=rng.choice(_CODE_TASKS)) if not code or rng.random() < 0.6 else
                 rng.choice(("Explain what this code does:\n```python\n{s}\n```",
                             "Add comments to this function:\n```python\n{s}\n```",
                             "Is there a bug in this code?\n```python\n{s}\n```")).format(s=rng.choice(code)))
        elif kind == "summary":
            p = rng.choice(("Summarize the following text:\n\n{s}", "Summarize this in one sentence:\n{s}",
                            "What are the key points of this text?\n\n{s}")).format(s=rng.choice(prose))
        elif kind == "math":
            p = _math(rng)
        elif kind == "rewrite":
            p = rng.choice(("Rewrite this sentence in simpler words: {s}", "Make this sentence more formal: {s}",
                            "Paraphrase: {s}", "Fix the grammar and improve the style: {s}"))
            p = p.format(s=rng.choice(sentences))
        else:
            p = f"Translate to {rng.choice(languages)}: {rng.choice(sentences)}"
        out.append((kind, p))
    return out


def meta_prompts(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """``n`` (kind, request) pairs: what the target is asked in order to write a prompt itself."""
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        out.append((kind, _WRITE_META[kind].format(t=rng.choice(TOPICS))))
    return out


def clean_written(kind: str, text: str, rng: random.Random) -> str | None:
    """The target's written text -> a prompt of ``kind`` (None when it is unusable)."""
    text = text.strip().strip('"').strip()
    if kind in ("chat", "explanation", "writing", "code", "math"):
        text = text.split("\n")[0].strip().strip('"')
        return text if 15 <= len(text) <= 300 else None
    if not 20 <= len(text) <= 1200:
        return None
    if kind == "summary":
        return f"Summarize the following text:\n\n{text}"
    if kind == "rewrite":
        return f"Rewrite this in a different style: {text}"
    return f"Translate to {rng.choice(('French', 'Spanish', 'German'))}: {text}"
