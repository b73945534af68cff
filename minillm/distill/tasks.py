"""The focused tasks a student learns: support messages made from seeded templates, their prompts and true answers.

Two tasks on the same kind of message (a short customer-support note):

    extract   the fields as one JSON object: {"name": ..., "order_id": ..., "product": ...}
    intent    the message's intent as one JSON object: {"intent": one of INTENTS}

Messages are written in code from templates, names, products and order numbers with a seeded
`random.Random`, so nothing is downloaded and every split is reproducible. The held-out split draws from
the same templates with another seed and drops any message that is also in the training split: the two
never share a text. `make_examples(task, "train", n)` -> [Example]; `prompt_text(task, message)` is the
few-shot prompt the teacher and the student both read.
"""

from __future__ import annotations

import dataclasses
import json
import random

INTENTS = ("refund", "shipping", "cancel", "account")
TASKS = ("extract", "intent")
SPLIT_SEEDS = {"train": 1234, "heldout": 98765}

FIRST_NAMES = ("Maria", "Tom", "Aisha", "Li", "Jonas", "Priya", "Carlos", "Emma", "Kenji", "Fatima", "Oliver",
               "Sofia", "Daniel", "Amara", "Lucas", "Hannah", "Mateo", "Chloe", "Ravi", "Ingrid", "Omar", "Grace",
               "Felix", "Nadia", "Samuel", "Yuki", "Elena", "Kwame", "Laura", "Marco")
LAST_NAMES = ("Lopez", "Becker", "Khan", "Wei", "Berg", "Patel", "Silva", "Dubois", "Tanaka", "Haddad", "Smith",
              "Rossi", "Novak", "Okafor", "Martin", "Schmidt", "Garcia", "Moreau", "Iyer", "Larsen", "Farah",
              "Kim", "Weber", "Petrova", "Mensah", "Sato", "Costa", "Boateng", "Fischer", "Romano")
PRODUCTS = ("blue kettle", "running shoes", "wireless mouse", "desk lamp", "coffee grinder", "yoga mat",
            "phone case", "rain jacket", "mechanical keyboard", "water bottle", "bluetooth speaker", "backpack",
            "toaster", "office chair", "winter gloves", "electric toothbrush", "camping tent", "hair dryer",
            "laptop stand", "wool scarf")

# {name} {order} {product}: each intent has its own phrasings (the intent is in the wording, never a keyword list).
TEMPLATES = {
    "refund": (
        "Hi, I'm {name}. My order {order} of a {product} arrived broken, I want my money back.",
        "Hello, the {product} from order {order} stopped working after two days. Please refund me. {name}",
        "I returned the {product} (order {order}) last week and still have not got my refund. Regards, {name}",
        "{name} here. Order {order}: the {product} is not what I paid for, I would like a refund.",
    ),
    "shipping": (
        "Hello, where is my parcel? Order {order}, a {product}, it's been two weeks. - {name}",
        "Hi, my {product} (order {order}) still shows 'in transit'. When will it arrive? {name}",
        "{name} writing: the tracking for order {order} has not moved in days. It's a {product}.",
        "Can you tell me when order {order} will be delivered? I ordered a {product}. Thanks, {name}",
    ),
    "cancel": (
        "Please cancel order {order} ({product}). Thanks, {name}",
        "Hi, this is {name}. I ordered a {product} by mistake, order {order}, please cancel it before it ships.",
        "I changed my mind about the {product}. Cancel order {order} please. {name}",
        "{name} here, I no longer need the {product} from order {order}. Can you cancel it?",
    ),
    "account": (
        "I can't log in to my account since I bought the {product} (order {order}). The reset email never comes. {name}",
        "Hi, {name} here. My account is locked after I placed order {order} for a {product}. Please help me get back in.",
        "Please change the email on my account, I used the wrong one for order {order} ({product}). {name}",
        "Hello, I ({name}) cannot see order {order} for my {product} because my password does not work anymore.",
    ),
}

# Two solved examples precede each message: a 135M model follows a pattern far better than an instruction.
FEW_SHOT = (
    ("Hi, I'm Anna Vogel. Order Q51234: my new lamp shade came cracked, I'd like my money back please.",
     {"name": "Anna Vogel", "order_id": "Q51234", "product": "lamp shade"}, "refund"),
    ("Good morning, please stop order R80021, I don't need the garden hose anymore. Peter Hall",
     {"name": "Peter Hall", "order_id": "R80021", "product": "garden hose"}, "cancel"),
)


@dataclasses.dataclass(frozen=True)
class Example:
    """One support message and its true answer for a task (the answer is the JSON text the task asks for)."""
    task: str
    message: str
    fields: dict
    intent: str

    @property
    def answer(self) -> str:
        return answer_text(self.task, self.fields, self.intent)


def answer_text(task: str, fields: dict, intent: str) -> str:
    check_task(task)
    return json.dumps(fields if task == "extract" else {"intent": intent})


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {list(TASKS)}")
    return task


def prompt_text(task: str, message: str) -> str:
    """The few-shot prompt (plain text, no chat template): solved examples, then the message and 'JSON:'."""
    check_task(task)
    head = ("Extract the customer's name, order id and product as JSON." if task == "extract" else
            f"Classify the customer's message as one intent: {', '.join(INTENTS)}. Answer as JSON.")
    shots = "".join(f"Message: {m}\nJSON: {answer_text(task, f, i)}\n\n" for m, f, i in FEW_SHOT)
    return f"{head}\n\n{shots}Message: {message}\nJSON:"


def _one(rng: random.Random, task: str) -> Example:
    intent = rng.choice(INTENTS)
    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    order = f"{rng.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}{rng.randrange(10000, 100000)}"
    product = rng.choice(PRODUCTS)
    message = rng.choice(TEMPLATES[intent]).format(name=name, order=order, product=product)
    return Example(task, message, {"name": name, "order_id": order, "product": product}, intent)


def make_examples(task: str, split: str, num_examples: int) -> list[Example]:
    """`num_examples` distinct messages of one split; the held-out split shares no message with the training one."""
    check_task(task)
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split {split!r} is not one of {list(SPLIT_SEEDS)}")
    if not 1 <= num_examples <= 5000:
        raise ValueError(f"num_examples={num_examples} is outside 1..5000")
    excluded = set() if split == "train" else {e.message for e in make_examples(task, "train", 5000)}
    rng = random.Random(f"{task}/{split}/{SPLIT_SEEDS[split]}")
    examples, seen = [], set(excluded)
    while len(examples) < num_examples:
        example = _one(rng, task)
        if example.message not in seen:
            seen.add(example.message)
            examples.append(example)
    return examples
