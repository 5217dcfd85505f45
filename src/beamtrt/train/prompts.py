"""Training prompts for drafter data: a deterministic mix of math, code and general instructions, no benchmark set.

The drafter learns to predict the target's own answers, so what matters is that the prompts exercise the kinds of
text the benchmarks ask for (step-by-step arithmetic, Python functions, explanations and stories) without being
the benchmark questions. Sources: reasoning-gym's procedural generators (every generator except `gsm_symbolic`,
whose templates come from the GSM8K test set the benchmark uses), word problems from templates below, function
stubs from the Python standard library's own signatures and docstrings, and templated general instructions.
"""

from __future__ import annotations

import inspect
import random
from typing import Callable

from beamtrt.errors import BeamtrtError

# reasoning-gym generators with short, well-posed math / logic questions (gsm_symbolic is excluded on purpose)
GYM_TASKS = ("basic_arithmetic", "leg_counting", "time_intervals", "simple_equations", "fraction_simplification",
             "products", "gcd", "lcm", "calendar_arithmetic", "aiw", "chain_sum", "prime_factorization",
             "simple_geometry", "coin_flip", "family_relationships", "complex_arithmetic", "syllogism",
             "letter_counting", "base_conversion", "number_sequence")
MATH_SUFFIXES = ("", " Solve it step by step.", " Explain your reasoning.", " Show your work.")

NAMES = ("Tom", "Maria", "Aisha", "Ken", "Lena", "Omar", "Sofia", "Raj", "Emma", "Diego", "Yuki", "Noah")
ITEMS = ("apples", "pencils", "stickers", "cookies", "marbles", "books", "cards", "flowers", "eggs", "coins")
WORD_PROBLEMS = (  # (template, answer rule) pairs are not needed: only the target's answer is used
    "{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?",
    "A box holds {x} {item}. {a} buys {y} boxes and uses {z} {item}. How many {item} are left?",
    "{a} reads {x} pages a day for {y} days, then {z} pages on the last day. How many pages did {a} read in total?",
    "A shop sells {item} for ${x} each. {a} buys {y} and pays with ${z}0. How much change does {a} get?",
    "{a} saves ${x} every week. After {y} weeks {a} spends ${z}. How much money is left?",
    "There are {x} students in a class. {y} of them walk to school and {z} take the bus. The rest ride bikes. "
    "How many ride bikes?",
    "{a} runs {x} kilometers on Monday, {y} on Tuesday and twice as many as Monday on Wednesday. How far did {a} "
    "run in total?",
    "A train travels at {x} km per hour for {y} hours. How far does it go? How long would {z}0 km take?",
    "{a} and {b} share {x}{y} {item} equally. Then {a} finds {z} more. How many does {a} have?",
    "A recipe needs {x} cups of flour for {y} cookies. How many cups are needed for {z}{y} cookies?",
)

TOPICS = ("photosynthesis", "black holes", "the water cycle", "machine learning", "the French Revolution",
          "inflation", "vaccines", "plate tectonics", "the internet", "climate change", "the stock market",
          "electric cars", "the human heart", "recycling", "volcanoes", "democracy", "gravity", "coffee",
          "the Roman Empire", "solar panels", "sleep", "honeybees", "chess", "the moon landing", "compilers",
          "rainbows", "antibiotics", "cryptocurrency", "the printing press", "ocean tides")
ACTIVITIES = ("learning a new language", "saving money", "staying focused", "running a marathon",
              "cooking for a family", "writing a resume", "starting a garden", "traveling on a budget",
              "public speaking", "learning to code", "moving to a new city", "keeping a houseplant alive")
GENERAL = ("Explain {topic} in simple terms.", "Write a short story about {topic}.",
           "What are the pros and cons of {topic}?", "Give me five interesting facts about {topic}.",
           "Write a short poem about {topic}.", "How would you explain {topic} to a ten-year-old?",
           "Give three tips for {activity}.", "Write an email to a friend about {activity}.",
           "What are common mistakes people make when {activity}?", "Make a one-week plan for {activity}.")
CODE = ("Write a Python function `{sig}` that does the following: {doc}",
        "Implement `{sig}` in Python. {doc}",
        "Write a Python function called `{name}`. {doc} Include a short example.")
CODE_MODULES = ("string", "textwrap", "statistics", "bisect", "heapq", "fnmatch", "shlex", "colorsys",
                "calendar", "difflib", "html", "ipaddress", "fractions", "posixpath", "base64", "random",
                "itertools", "functools", "operator", "math", "json", "csv", "urllib.parse", "copy", "glob")

MIX = (("math", 0.4), ("code", 0.3), ("general", 0.3))


def _gym_prompts(n: int, seed: int) -> list[str]:
    try:
        import reasoning_gym
    except ImportError:
        raise BeamtrtError("reasoning-gym is not installed: pip install 'beamtrt[train]' "
                           "(or reasoning-gym==0.1.25)") from None
    rng = random.Random(seed)
    out = []
    per_task = -(-n // len(GYM_TASKS))
    for i, task in enumerate(GYM_TASKS):
        for item in reasoning_gym.create_dataset(task, size=per_task, seed=seed + i):
            out.append(item["question"].strip() + rng.choice(MATH_SUFFIXES))
    rng.shuffle(out)
    return out[:n]


def _word_problems(n: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        out.append(rng.choice(WORD_PROBLEMS).format(a=a, b=b, item=rng.choice(ITEMS), x=rng.randint(2, 60),
                                                    y=rng.randint(2, 12), z=rng.randint(1, 9))
                   + rng.choice(MATH_SUFFIXES))
    return out


def _stdlib_functions() -> list[tuple[str, str, str]]:
    """(name, signature, first docstring sentence) of documented public functions in a few stdlib modules."""
    import importlib

    found = []
    for mod_name in CODE_MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ").strip()
            try:
                sig = f"{name}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                continue
            if 20 <= len(doc) <= 300 and len(sig) <= 80:
                found.append((name, sig, doc))
    return found


def _code_prompts(n: int, rng: random.Random) -> list[str]:
    funcs = _stdlib_functions()
    return [rng.choice(CODE).format(name=name, sig=sig, doc=doc)
            for name, sig, doc in (rng.choice(funcs) for _ in range(n))]


def _general_prompts(n: int, rng: random.Random) -> list[str]:
    return [rng.choice(GENERAL).format(topic=rng.choice(TOPICS), activity=rng.choice(ACTIVITIES))
            for _ in range(n)]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """Up to n distinct prompts, deterministic: 40% math (half reasoning-gym, half word problems), 30% code,
    30% general."""
    if n < 1:
        raise ValueError(f"number of training prompts must be >= 1, got {n}")
    rng = random.Random(seed)
    counts = {kind: int(n * share) for kind, share in MIX}
    counts["math"] += n - sum(counts.values())
    makers: dict[str, Callable[[int], list[str]]] = {
        "math": lambda k: _gym_prompts(k // 2, seed) + _word_problems(k - k // 2, rng),
        "code": lambda k: _code_prompts(k, rng),
        "general": lambda k: _general_prompts(k, rng),
    }
    prompts = []
    for kind, _ in MIX:  # over-draw, then keep distinct prompts (a template mix repeats itself)
        distinct = list(dict.fromkeys(makers[kind](3 * counts[kind])))
        prompts += distinct[:counts[kind]]
    rng.shuffle(prompts)
    return prompts
