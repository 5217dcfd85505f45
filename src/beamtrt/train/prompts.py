"""Training prompts for drafter data: a deterministic mix of math, code and general instructions, no benchmark set.

The drafter learns to predict the target's own answers, so what matters is that the prompts exercise the kinds of
text the benchmarks ask for (step-by-step arithmetic, Python functions, explanations and stories) without being
the benchmark questions. Sources: reasoning-gym's procedural generators (the 20 of `GYM_TASKS`, the 28 of
`GYM_TASKS_V3` in mixes v3 and v4; never `gsm_symbolic`, whose templates come from the GSM8K test set the benchmark
uses), word problems from templates below, function stubs from the Python standard library's own signatures and
docstrings, and templated general instructions.

Mix "v2" (the default) adds what "v1" (the first three drafters' data) lacked: the instruction wrappers the
evaluations put around their questions (a step-by-step / boxed-answer suffix, a complete-this-function prefix) on
non-benchmark content, twice as many word-problem templates, HumanEval-style stubs of reasoning-gym's CodeI/O tasks,
and MT-Bench-style writing, role-play, extraction and knowledge requests, some over passages of a public-domain story
that reasoning-gym ships (Jules Verne, "In the Year 2889"). Mix "v3" leans toward the benchmark families the
drafter was weakest on: longer multi-step word problems, MATH-like generators, half the math boxed, more chat.
Mix "v4" is over half open-ended writing (blog posts, emails, stories, letters, reviews, speeches, poems) and
role-play in a persona, the kinds of request MT-Bench opens with, beside a smaller share of v3's kinds.
"""

from __future__ import annotations

import inspect
import random
from typing import Callable

from beamtrt.bench.prompt_sets import CODE_PREFIX, _package_file
from beamtrt.bench.prompt_sets import MATH_SUFFIX as BOXED  # the evaluations' wrappers
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
WORD_PROBLEMS_V2 = WORD_PROBLEMS + (
    "{a} buys {y} notebooks at ${x} each and {z} pens at $2 each. {a} has a coupon for 10% off the total. How much "
    "does {a} pay?",
    "{a} is {x} years old. {b} is {y} years older than {a}. In {z} years, what will the sum of their ages be?",
    "A garden is {x} meters long and {y} meters wide. {a} wants to put a fence around it and plant grass on half of "
    "it. How many meters of fence are needed, and how many square meters get grass?",
    "{a} earns ${x} per hour and works {y} hours a week. {a} spends a quarter of the weekly pay on food and ${z}0 "
    "on rent. How much is left each week?",
    "A bakery makes {x}0 loaves of bread a day. It sells {y}0 in the morning and half of the rest in the afternoon. "
    "How many loaves are left at the end of the day?",
    "{a} has {x} {item}, which is {z} times as many as {b}. {b} then buys {y} more. How many {item} do they have "
    "together?",
    "A tank holds {x}0 liters of water. It leaks {y} liters per hour, and {a} adds {z} liters every two hours. How "
    "much water is in the tank after 6 hours?",
    "In a school of {x}0 students, {y}0% play soccer and a third of the rest play basketball. How many students play "
    "neither?",
    "{a} drives {x}0 km at {y}0 km per hour, then stops for {z}0 minutes, then drives another {x}0 km at twice the "
    "speed. How long does the whole trip take?",
    "A shirt costs ${x}. It is on sale for {z}0% off, and there is a {y}% sales tax on the sale price. What is the "
    "final price?",
    "{a} collects {item}. On the first day {a} gets {x}, and each day after that {a} gets {y} more than the day "
    "before. How many {item} does {a} have after {z} days?",
    "{a} and {b} paint a fence together. {a} paints {x} meters an hour and {b} paints {y} meters an hour. The fence "
    "is {z}0 meters long. How long does it take them?",
    "A farmer has {x} cows and {y} chickens. Each cow eats {z} kg of hay a day. How many legs are on the farm, and "
    "how much hay do the cows eat in a week?",
    "{a} wants to buy a bike that costs ${x}0. {a} has ${y}0 and saves ${z}0 a month. How many months until {a} can "
    "buy the bike?",
    "A movie starts at {y}:15 pm and lasts {x}0 minutes longer than 2 hours. {a} needs {z}0 minutes to get home "
    "after it ends. What time does {a} get home?",
)
# v3: longer, GSM8K-shaped problems (four to six quantities, several steps, money / time / rates / percentages);
# written here, like the templates above ({w} is a larger number, 10-500)
WORD_PROBLEMS_V3 = (
    "{a}'s hens lay {x} eggs a day. {a} uses {z} eggs for breakfast and {y} for baking every day, and sells the "
    "rest at the market for ${z} a dozen. How much money does {a} make in a week?",
    "{a} buys {y} packs of {item} with {x} in each pack. {a} gives {z} {item} to each of {y} friends and keeps the "
    "rest in {z} equal piles. How many {item} are in each pile?",
    "A school trip costs ${w} for the bus plus ${x} per student. {y}0 students go, and the school pays {z}0% of the "
    "total. How much does each student pay?",
    "{a} works {y} hours on weekdays and {z} hours on Saturday. {a} earns ${x} an hour on weekdays and one and a "
    "half times that on Saturday. How much does {a} earn in four weeks?",
    "A store had {w} {item}. On Monday it sold a quarter of them, on Tuesday {x} more than on Monday, and on "
    "Wednesday it received a delivery of {y}0. How many {item} does the store have now?",
    "{a} is training for a race. In the first week {a} runs {z} km a day for {y} days. Each week after that, {a} "
    "runs {x}% more than the week before. How many km does {a} run in the third week?",
    "{a} has ${w}. {a} spends a fifth of it on a jacket, ${x} on shoes, and half of what is left on {item}. How "
    "much money does {a} have left?",
    "A water bottle holds {x}00 ml. {a} drinks {y} bottles a day on weekdays and {z} bottles a day on weekends. How "
    "many liters does {a} drink in two weeks?",
    "{a} and {b} sell {item} at a fair. {a} sells {x} at ${z} each and {b} sells {y} more than {a} at ${z} less "
    "than {a}'s price plus $2. How much money do they make together?",
    "A printer prints {x} pages a minute. {a} needs {y} copies of a {w}-page report. If the printer stops for {z} "
    "minutes every hour to cool down, how long does the job take?",
    "{a} plants {y} rows of tomatoes with {x} plants in each row. Each plant gives {z} kg of tomatoes, and {a} "
    "sells them for $3 per kg after keeping a tenth for the family. How much money does {a} make?",
    "A car uses {z} liters of fuel per 100 km. {a} drives {w} km to visit {b} and back. Fuel costs $2 per liter. "
    "How much does the fuel for the trip cost?",
    "{a} read {x} pages on Monday, twice as many on Tuesday, and {y} fewer than Tuesday on Wednesday. The book has "
    "{w} pages. How many pages are left?",
    "A pizza is cut into {y} slices. {a} orders {z} pizzas for a party of {x} people. If everyone eats the same "
    "number of whole slices, how many slices does each person get, and how many are left over?",
    "{a} rents a bike for ${z} plus ${y} per hour. {b} rents one for ${x} a day. For how many hours is {a}'s bike "
    "cheaper than {b}'s?",
    "A phone costs ${w}0. {a} pays ${x}0 now and the rest in {y} equal monthly payments with an extra ${z} fee "
    "each month. How much is each monthly payment?",
    "There are {w} people at a concert. {x}% of them are children, and a third of the adults bought a T-shirt for "
    "${y}. How much money was spent on T-shirts?",
    "{a} is {x} years old. {a}'s mother is {z} times as old as {a} was {y} years ago. How old will {a}'s mother be "
    "when {a} is twice as old as now?",
    "A baker uses {z} eggs and {y}00 g of flour for one cake. The baker has {w} eggs and {x} kg of flour. How many "
    "cakes can the baker make, and what runs out first?",
    "{a} swims {x} laps on Monday. Each day {a} swims {z} more laps than the day before. A lap is {y}0 meters. How "
    "many meters does {a} swim from Monday to Friday?",
    "A class of {x} students votes for a trip. {y}0% want the zoo, {z} students want the museum and the rest want "
    "the beach. How many more students want the zoo than the beach?",
    "{a} buys {y} shirts at ${x} each and {z} pairs of pants at twice the price of a shirt. The store gives 15% off "
    "purchases over $100. How much does {a} pay?",
    "A tank is filled by a pipe at {x} liters a minute and drained by another at {z} liters a minute. The tank "
    "holds {w}0 liters. Starting empty, how long does it take to fill with both pipes open?",
    "{a} has {x} {item} and {b} has {y} times as many. {b} gives {a} enough {item} so that they have the same "
    "number. How many {item} does {b} give {a}?",
)
# v3: reasoning-gym generators closer to MATH-500's algebra, geometry, counting and probability
GYM_TASKS_V3 = GYM_TASKS + ("advanced_geometry", "polynomial_equations", "polynomial_multiplication",
                            "simple_integration", "decimal_arithmetic", "power_function", "count_primes", "dice")

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
CODE_STUB = '{prefix}def {name}{args}:\n    """{doc}\n    """\n'
CODE_MODULES = ("string", "textwrap", "statistics", "bisect", "heapq", "fnmatch", "shlex", "colorsys",
                "calendar", "difflib", "html", "ipaddress", "fractions", "posixpath", "base64", "random",
                "itertools", "functools", "operator", "math", "json", "csv", "urllib.parse", "copy", "glob")

NAMES_V2 = NAMES + ("Priya", "Jamal", "Chloe", "Mateo", "Hannah", "Wei", "Fatima", "Lucas", "Grace", "Ivan")
ITEMS_V2 = ITEMS + ("stamps", "shells", "toy cars", "cupcakes", "bottles", "seeds", "beads", "tickets")

ROLES = ("a pirate captain", "a tour guide in Rome", "a detective", "a medieval knight", "a customer support agent",
         "a chef", "a personal trainer", "a museum curator", "a spaceship engineer", "a kindergarten teacher",
         "Sherlock Holmes", "a travel agent", "a job interviewer", "a wise old wizard", "a sports commentator")
TASKS = ("introduce yourself and describe a typical day", "give advice to someone who is nervous about {activity}",
         "explain {topic} to a visitor", "describe the most surprising thing you have seen",
         "answer the question: what makes a good leader?", "convince me to try {activity}")
PLACES = ("Kyoto", "Iceland", "Morocco", "New Orleans", "the Scottish Highlands", "Patagonia", "Vienna",
          "the Amalfi Coast", "Hanoi", "Cape Town", "Istanbul", "Banff")
CHAT = ("Pretend you are {role}. {task_cap}.", "Act as {role} and {task}.",
        "Write a persuasive essay arguing for {topic}.", "Compose an engaging travel blog post about a trip to "
        "{place}, highlighting culture and must-see attractions.",
        "Draft a professional email asking a colleague for feedback on a report about {topic}.",
        "Describe {topic} as if you were writing an encyclopedia entry.",
        "Write a dialogue between two friends debating {topic}.",
        "What would happen if {topic} suddenly disappeared? Think it through step by step.",
        "Compare {topic} and {topic2}: how are they similar and how are they different?",
        "Write a product description for a new gadget related to {topic}.",
        "Imagine you are planning a three-day trip to {place}. Write an itinerary.",
        "Explain the history of {topic} in a few paragraphs.")
PASSAGE = ("Summarize the following passage in two or three sentences.\n\n{text}",
           "Extract every person, place and invention mentioned in the text below, as a list.\n\n{text}",
           "Rewrite this paragraph in plain modern English.\n\n{text}",
           "What is the main idea of this passage? Answer briefly.\n\n{text}",
           "Read the text and write three questions a teacher could ask about it.\n\n{text}",
           "{text}\n\nContinue this story for one more paragraph.")

# v4: MT-Bench's first turns are writing and role-play requests, on which run 8 drafted 0.3 below its level on the
# v3 chat answers it never saw (docs/DRAFTER.md, "Run 12"); these are written here in that spirit (open-ended writing
# with a form and an audience, personas answering in character), none of them an MT-Bench question
WRITE = ("Write a {length} blog post about {experience}, with vivid details and practical tips for readers.",
         "Draft a {tone} email to {recipient} about {matter}.",
         "Write a short story that begins with the sentence: \"{opening}\"",
         "Describe {character} in a vivid paragraph, using strong imagery and creative language.",
         "Write a descriptive paragraph about {scene}, appealing to sight, sound, smell and touch.",
         "Write a persuasive letter to {recipient} convincing them to {action}. Address their likely objections.",
         "Come up with four catchy headlines for an article about {topic}, then say which one works best and why.",
         "Write a review of {product}: what you liked, what you did not, and who should buy it.",
         "Write a short speech for {occasion}. Make it warm and a little funny.",
         "Compose a {form} about {topic}.",
         "Write a cover letter for a job as {job}, highlighting relevant experience.",
         "Write the opening scene of a {genre} novel set in {place}.",
         "Write a {length} article for a school newsletter about {topic}.",
         "Write a social media post announcing {matter}, and suggest three hashtags.")
LENGTHS = ("short", "300-word", "detailed", "friendly", "two-paragraph")
TONES = ("professional", "polite", "friendly", "formal", "apologetic", "enthusiastic")
RECIPIENTS = ("your manager", "a new neighbor", "your landlord", "a customer", "your city council",
              "a former teacher", "your team", "a local newspaper", "your best friend", "a hotel manager")
MATTERS = ("a project deadline that has to move", "a community cleanup this weekend", "a broken heater",
           "a new product launch", "a change in the meeting schedule", "a charity bake sale",
           "a lost package", "the results of a customer survey", "a team outing", "a new recycling program")
OPENINGS = ("The letter arrived twenty years too late.", "Nobody in the village had ever seen the lighthouse dark.",
            "The robot had one question it was not allowed to ask.", "It started raining upward on a Tuesday.",
            "My grandmother kept a locked box under her bed.", "The last train of the night stopped in the middle "
            "of nowhere.", "The map showed an island that was not there yesterday.",
            "Everyone at the party heard the piano play by itself.")
CHARACTERS = ("an old fisherman who talks to the sea", "a young inventor with too many ideas",
              "a street musician in a busy city", "a retired spy who now grows roses",
              "a shy dragon who loves books", "a bus driver who knows every passenger's story",
              "a clockmaker who is always late", "a mountain guide with a secret")
SCENES = ("a night market in a busy city", "a small harbor at dawn", "a train station during a snowstorm",
          "a crowded football stadium", "a forest after the rain", "a bakery early in the morning",
          "a desert town at noon", "a library on the last day before summer")
ACTIONS = ("volunteer at an animal shelter", "start cycling to work", "join a community choir",
           "read one book a month", "try a week without a smartphone", "plant a tree in their yard",
           "learn to cook one new dish a week", "visit a local museum")
PRODUCTS = ("a pair of noise-cancelling headphones", "a budget smartphone", "an electric scooter",
            "a smart watch for runners", "a coffee grinder", "a robot vacuum cleaner", "an e-book reader",
            "a camping tent for two")
OCCASIONS = ("a friend's wedding", "a retirement party", "a school graduation", "the opening of a new library",
             "a team's end-of-year dinner", "a grandparent's 90th birthday")
FORMS = ("haiku sequence", "limerick", "sonnet", "free-verse poem", "short ballad", "poem for children")
JOBS = ("a software developer", "a museum guide", "a nurse", "a park ranger", "a graphic designer", "a chef",
        "a data analyst", "a primary school teacher")
GENRES = ("mystery", "science fiction", "fantasy", "historical", "comedy", "thriller")
ROLE = ("Pretend to be {persona}. {question}", "From now on, act as {persona} and stay in character. {question}",
        "Embody {persona} and answer in that voice: {question}",
        "You are {persona}. A visitor asks you: \"{question}\" How do you reply?",
        "Imagine yourself as {persona}. Describe how you would {scenario}.")
PERSONAS = ("an astronaut just back from a year in orbit", "Albert Einstein", "a grumpy but kind librarian",
            "a 19th-century sea captain", "a superhero who is tired of saving the city",
            "a startup founder pitching to investors", "a nutritionist", "a stand-up comedian",
            "a park ranger in Yellowstone", "Leonardo da Vinci", "a math teacher who loves puns", "a veterinarian",
            "a relationship counselor", "a film critic", "a video game character who knows it is in a game",
            "a lawyer", "a time traveler from the year 3000", "a barista", "a famous chef", "Marie Curie",
            "a football coach at half-time", "a fortune teller", "an ancient Greek philosopher",
            "a weather forecaster")
QUESTIONS = ("What advice would you give to a young person starting out?", "What is the hardest part of your job?",
             "What do you think about social media?", "How do you handle stress?",
             "Tell me about a day you will never forget.", "Why should people care about what you do?",
             "What would you change about the world?", "Can you recommend a good book and say why?",
             "What is a common misconception about you?", "How do you start your mornings?")
SCENARIOS = ("spend a rainy Sunday", "settle an argument between two friends", "teach a child to ride a bike",
             "plan a surprise party", "get through a day when everything goes wrong", "welcome a new neighbor")

GYM_INSTALL = "pip install 'beamtrt[train]' (or reasoning-gym==0.1.25)"
MIX = (("math", 0.4), ("code", 0.3), ("general", 0.3))
MIX_V2 = (("gym", 0.2), ("word", 0.15), ("code", 0.1), ("stub", 0.2), ("general", 0.1), ("chat", 0.15),
          ("passage", 0.1))
MIX_V3 = (("gym3", 0.15), ("word3", 0.25), ("code", 0.05), ("stub", 0.15), ("general", 0.05), ("chat", 0.25),
          ("passage", 0.1))
MIX_V4 = (("write", 0.35), ("role", 0.2), ("chat", 0.1), ("word3", 0.15), ("gym3", 0.05), ("stub", 0.1),
          ("passage", 0.05))
MIXES = {"v1": MIX, "v2": MIX_V2, "v3": MIX_V3, "v4": MIX_V4}


def _gym_prompts(n: int, seed: int, suffixes: tuple[str, ...] = MATH_SUFFIXES,
                 tasks: tuple[str, ...] = GYM_TASKS) -> list[str]:
    try:
        import reasoning_gym
    except ImportError:
        raise BeamtrtError("reasoning-gym is not installed: pip install 'beamtrt[train]' "
                           "(or reasoning-gym==0.1.25)") from None
    if n == 0:  # a small mix's share (reasoning-gym refuses a dataset of size 0)
        return []
    rng = random.Random(seed)
    out = []
    per_task = -(-n // len(tasks))
    for i, task in enumerate(tasks):
        for item in _hash_free(reasoning_gym.create_dataset(task, size=per_task, seed=seed + i)):
            out.append(item["question"].strip() + rng.choice(suffixes))
    rng.shuffle(out)
    return out[:n]


def _hash_free(dataset):
    """`dataset` with the same questions in every process: polynomial_multiplication draws its monomials from a list
    of sympy's itermonomials set, whose order follows the process's string hashing (PYTHONHASHSEED), so a few of its
    questions changed from run to run (a resumed cache, eval_drafter.py's prompt kinds). Sorted, they do not."""
    draw = getattr(dataset, "_get_monomials", None)
    if draw is not None:
        from sympy import default_sort_key

        dataset._get_monomials = lambda rng: sorted(draw(rng), key=default_sort_key)
    return dataset


def _word_problems(n: int, rng: random.Random, templates: tuple[str, ...] = WORD_PROBLEMS,
                   names: tuple[str, ...] = NAMES, items: tuple[str, ...] = ITEMS,
                   suffixes: tuple[str, ...] = MATH_SUFFIXES, big: bool = False) -> list[str]:
    """big: also draw {w} (10-500) for the v3 templates (only then, so v1 / v2 prompts stay as they were)."""
    out = []
    for _ in range(n):
        a, b = rng.sample(names, 2)
        template = rng.choice(templates)  # drawn before the values, as v1 / v2 always did
        values = dict(a=a, b=b, item=rng.choice(items), x=rng.randint(2, 60), y=rng.randint(2, 12),
                      z=rng.randint(1, 9))
        if big:
            values["w"] = rng.randint(10, 500)
        out.append(template.format(**values) + rng.choice(suffixes))
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


def _codeio_tasks() -> list[tuple[str, str]]:
    """(argument list, description) of reasoning-gym's CodeI/O tasks whose description is short enough."""
    import gzip
    import json

    path = _package_file("reasoning_gym", "data/codeio.jsonl.gz", GYM_INSTALL)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            head = next((ln for ln in row["code_sample"].splitlines() if ln.startswith("def main_solution(")), None)
            doc = row["task_description"].strip() + "\n\n" + row["input_output_spec"].strip()
            if head and head.endswith(":") and len(doc) <= 900:
                out.append((head[len("def main_solution"):-1], doc))
    return out


def _indent(text: str) -> str:
    return "\n".join(("    " + ln) if ln.strip() else "" for ln in text.splitlines())


def _stub_prompts(n: int, rng: random.Random) -> list[str]:
    """HumanEval-style stubs: three in four from CodeI/O task descriptions, one in four from stdlib docstrings."""
    tasks, funcs = _codeio_tasks(), _stdlib_functions()
    out = []
    for _ in range(n):
        if rng.random() < 0.75:
            args, doc = rng.choice(tasks)
            name = "main_solution"
        else:
            name, sig, doc = rng.choice(funcs)
            args = sig[len(name):]
        prefix = CODE_PREFIX if rng.random() < 0.8 else ""
        out.append(CODE_STUB.format(prefix=prefix, name=name, args=args, doc=_indent(doc).lstrip()))
    return out


def _chat_prompts(n: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(n):
        task = rng.choice(TASKS).format(topic=rng.choice(TOPICS), activity=rng.choice(ACTIVITIES))
        t1, t2 = rng.sample(TOPICS, 2)
        out.append(rng.choice(CHAT).format(role=rng.choice(ROLES), task=task, task_cap=task[0].upper() + task[1:],
                                           topic=t1, topic2=t2, place=rng.choice(PLACES)))
    return out


def _write_prompts(n: int, rng: random.Random) -> list[str]:
    fields = dict(length=LENGTHS, experience=PLACES + ACTIVITIES, tone=TONES, recipient=RECIPIENTS, matter=MATTERS,
                  opening=OPENINGS, character=CHARACTERS, scene=SCENES, action=ACTIONS, topic=TOPICS,
                  product=PRODUCTS, occasion=OCCASIONS, form=FORMS, job=JOBS, genre=GENRES, place=PLACES)
    return [rng.choice(WRITE).format(**{k: rng.choice(v) for k, v in fields.items()}) for _ in range(n)]


def _role_prompts(n: int, rng: random.Random) -> list[str]:
    return [rng.choice(ROLE).format(persona=rng.choice(PERSONAS), question=rng.choice(QUESTIONS),
                                    scenario=rng.choice(SCENARIOS)) for _ in range(n)]


def _passages() -> list[str]:
    """Paragraph runs of 300–700 characters from the public-domain story reasoning-gym ships."""
    text = _package_file("reasoning_gym", "data/in_the_year_2889.txt", GYM_INSTALL).read_text("utf-8")
    out, run = [], ""
    for para in (" ".join(p.split()) for p in text.split("\n\n")):
        run = f"{run}\n\n{para}" if run else para
        if len(run) >= 300:
            if len(run) <= 700:
                out.append(run)
            run = ""
    return out


def _passage_prompts(n: int, rng: random.Random) -> list[str]:
    texts = _passages()
    return [rng.choice(PASSAGE).format(text=rng.choice(texts)) for _ in range(n)]


def training_prompts(n: int, seed: int = 0, mix: str = "v2") -> list[str]:
    """Up to n distinct prompts, deterministic (tagged_prompts without the kinds)."""
    return [prompt for prompt, _ in tagged_prompts(n, seed, mix)]


def tagged_prompts(n: int, seed: int = 0, mix: str = "v2") -> list[tuple[str, str]]:
    """Up to n distinct (prompt, kind) pairs, deterministic; the kinds are the mix's (MIXES). Mix "v1": 40% math
    (half reasoning-gym, half word problems), 30% code, 30% general; "v2" (MIX_V2): also stubs, chat, passages, and
    the evaluation wrappers; "v3" (MIX_V3): more and longer word problems, MATH-like generators, more chat, half of
    the math with the boxed-answer wrapper; "v4" (MIX_V4): over half open-ended writing and role-play requests, the
    rest v3's kinds."""
    if n < 1:
        raise ValueError(f"number of training prompts must be >= 1, got {n}")
    if mix not in MIXES:
        raise BeamtrtError(f"unknown prompt mix {mix!r}: choose from {', '.join(MIXES)}")
    rng = random.Random(seed)
    counts = {kind: int(n * share) for kind, share in MIXES[mix]}
    counts[MIXES[mix][0][0]] += n - sum(counts.values())
    suffixes = MATH_SUFFIXES + (BOXED,) * 2  # v2: a third of the math carries the evaluation wrapper
    suffixes_v3 = MATH_SUFFIXES + (BOXED,) * 4  # v3: half of it
    makers: dict[str, Callable[[int], list[str]]] = {
        "math": lambda k: _gym_prompts(k // 2, seed) + _word_problems(k - k // 2, rng),
        "code": lambda k: _code_prompts(k, rng),
        "general": lambda k: _general_prompts(k, rng),
        "gym": lambda k: _gym_prompts(k, seed, suffixes),
        "word": lambda k: _word_problems(k, rng, WORD_PROBLEMS_V2, NAMES_V2, ITEMS_V2, suffixes),
        "stub": lambda k: _stub_prompts(k, rng),
        "chat": lambda k: _chat_prompts(k, rng),
        "passage": lambda k: _passage_prompts(k, rng),
        "gym3": lambda k: _gym_prompts(k, seed, suffixes_v3, GYM_TASKS_V3),
        "word3": lambda k: _word_problems(k, rng, WORD_PROBLEMS_V2 + WORD_PROBLEMS_V3, NAMES_V2, ITEMS_V2,
                                          suffixes_v3, big=True),
        "write": lambda k: _write_prompts(k, rng),
        "role": lambda k: _role_prompts(k, rng),
    }
    prompts = []
    for kind, _ in MIXES[mix]:  # over-draw, then keep distinct prompts (a template mix repeats itself)
        distinct = list(dict.fromkeys(makers[kind](3 * counts[kind])))
        prompts += [(prompt, kind) for prompt in distinct[:counts[kind]]]
    rng.shuffle(prompts)
    return prompts
