"""Generate math-word-problems.jsonl: grade-school math problems in GSM8K's format (no GSM8K items).

Why generated: the GSM8K train split is not reachable from this project's machines (no PyPI package
ships it), and qpipe evaluates on the GSM8K test split, so calibrating on test items would leak the
evaluation. These problems are written from templates with every number computed here; the answers
follow GSM8K's format (one step per line, `<<expr=value>>` calculator annotations, `#### N` last),
so they calibrate on the same kind of text without being GSM8K items.

    python calibration/make_math.py            # rewrites calibration/math-word-problems.jsonl
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

SEED = 20241130
COUNT = 800
OUT = Path(__file__).with_name("math-word-problems.jsonl")

NAMES = [
    "Ava", "Ben", "Carla", "Diego", "Elena", "Farid", "Grace", "Hiro", "Imani", "Jonas",
    "Keiko", "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sami", "Tariq",
    "Uma", "Victor", "Wen", "Ximena", "Yusuf", "Zoe", "Marcus", "Leila", "Tomas", "Nadia",
]  # fmt: skip
FRUITS = ["apples", "oranges", "pears", "peaches", "plums", "lemons", "mangoes", "kiwis"]
SNACKS = ["cupcakes", "cookies", "muffins", "brownies", "granola bars", "pretzels"]
ITEMS = ["notebooks", "pencils", "markers", "stickers", "erasers", "folders", "rulers"]
COLLECTIONS = ["stamps", "coins", "trading cards", "seashells", "postcards", "marbles"]
PETS = ["dogs", "cats", "rabbits", "goats", "ponies"]

Problem = tuple[str, list[str], int]


def step(expr: str, value: int, before: str = "", after: str = "") -> str:
    """One GSM8K-style line: text, the expression, its calculator annotation, the value."""
    return f"{before}{expr} = <<{expr.replace(' ', '')}={value}>>{value}{after}"


def shopping(r: random.Random) -> Problem:
    name, a, b = r.choice(NAMES), r.randint(2, 9), r.randint(2, 9)
    item1, item2 = r.sample(ITEMS, 2)
    p, q = r.randint(2, 12), r.randint(1, 8)
    bill = r.choice([50, 100, 200])
    while a * p + b * q > bill:
        a, b = max(1, a - 1), max(1, b - 1)
    c1, c2 = a * p, b * q
    total, change = c1 + c2, bill - c1 - c2
    question = (
        f"{name} buys {a} {item1} at ${p} each and {b} {item2} at ${q} each. "
        f"{name} pays with a ${bill} bill. How much change does {name} get back?"
    )
    lines = [
        step(f"{a} * {p}", c1, f"The {item1} cost ", " dollars."),
        step(f"{b} * {q}", c2, f"The {item2} cost ", " dollars."),
        step(f"{c1} + {c2}", total, "Altogether that is ", " dollars."),
        step(f"{bill} - {total}", change, f"So {name} gets back ", " dollars."),
    ]
    return question, lines, change


def farm_sales(r: random.Random) -> Problem:
    name, fruit = r.choice(NAMES), r.choice(FRUITS)
    picked, eaten, given = r.randint(30, 90), r.randint(2, 9), r.randint(3, 12)
    price = r.randint(1, 5)
    left = picked - eaten - given
    money = left * price
    question = (
        f"{name} picks {picked} {fruit} from the orchard. {name} eats {eaten} of them and gives "
        f"{given} to a neighbor. {name} sells the rest at the market for ${price} each. "
        f"How many dollars does {name} make?"
    )
    lines = [
        step(f"{picked} - {eaten} - {given}", left, f"{name} has ", f" {fruit} left to sell."),
        step(f"{left} * {price}", money, f"{name} makes ", " dollars."),
    ]
    return question, lines, money


def reading(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    per_day, days = r.randint(8, 30), r.randint(3, 9)
    read = per_day * days
    pages = read + r.randint(20, 200)
    left = pages - read
    question = (
        f"A book has {pages} pages. {name} reads {per_day} pages every day for {days} days. "
        f"How many pages does {name} still have to read?"
    )
    lines = [
        step(f"{per_day} * {days}", read, f"{name} reads ", " pages."),
        step(f"{pages} - {read}", left, "There are ", " pages left."),
    ]
    return question, lines, left


def road_trip(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    s1, h1, s2, h2 = r.randint(4, 13) * 5, r.randint(2, 6), r.randint(4, 13) * 5, r.randint(1, 4)
    d1, d2 = s1 * h1, s2 * h2
    total = d1 + d2
    question = (
        f"{name} drives at {s1} miles per hour for {h1} hours, then at {s2} miles per hour for "
        f"{h2} more hours. How many miles does {name} drive in total?"
    )
    lines = [
        step(f"{s1} * {h1}", d1, "The first part is ", " miles."),
        step(f"{s2} * {h2}", d2, "The second part is ", " miles."),
        step(f"{d1} + {d2}", total, "In total that is ", " miles."),
    ]
    return question, lines, total


def wages(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    rate, hours, days, bonus = r.randint(9, 25), r.randint(3, 8), r.randint(3, 6), r.randint(2, 9)
    per_day = rate * hours
    week = per_day * days
    total = week + bonus * 10
    question = (
        f"{name} earns ${rate} an hour and works {hours} hours a day, {days} days a week. "
        f"This week {name} also got a ${bonus * 10} bonus. How much did {name} earn this week?"
    )
    lines = [
        step(f"{rate} * {hours}", per_day, f"Each day {name} earns ", " dollars."),
        step(f"{per_day} * {days}", week, "For the week that is ", " dollars."),
        step(f"{week} + {bonus * 10}", total, "With the bonus it is ", " dollars."),
    ]
    return question, lines, total


def discount(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(["jacket", "lamp", "backpack", "bicycle", "guitar"])
    percent = r.choice([10, 20, 25, 30, 40, 50])
    price = r.randint(2, 30) * 20
    off = price * percent // 100
    sale = price - off
    count = r.randint(2, 4)
    total = sale * count
    question = (
        f"A {item} normally costs ${price}. The store takes {percent}% off. {name} buys {count} "
        f"of them at the sale price. How much does {name} pay?"
    )
    lines = [
        step(f"{price} * {percent} / 100", off, "The discount is ", " dollars."),
        step(f"{price} - {off}", sale, f"Each {item} costs ", " dollars on sale."),
        step(f"{sale} * {count}", total, f"{name} pays ", " dollars."),
    ]
    return question, lines, total


def classroom(r: random.Random) -> Problem:
    denominator = r.choice([2, 3, 4, 5])
    students = denominator * r.randint(5, 10)
    walk = students // denominator
    rest = students - walk
    bike = r.randint(1, rest - 1)
    bus = rest - bike
    question = (
        f"A class has {students} students. One in {denominator} of them walk to school, "
        f"{bike} ride a bike and the rest take the bus. How many students take the bus?"
    )
    lines = [
        step(f"{students} / {denominator}", walk, "", " students walk."),
        step(f"{students} - {walk} - {bike}", bus, "", " students take the bus."),
    ]
    return question, lines, bus


def savings(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    weekly, weeks = r.randint(3, 20), r.randint(4, 12)
    saved = weekly * weeks
    spent = r.randint(1, saved // 2)
    left = saved - spent
    question = (
        f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a gift. "
        f"How much money does {name} have left?"
    )
    lines = [
        step(f"{weekly} * {weeks}", saved, f"{name} saves ", " dollars."),
        step(f"{saved} - {spent}", left, f"{name} has ", " dollars left."),
    ]
    return question, lines, left


def garden(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    rows, per_row, per_plant = r.randint(3, 12), r.randint(4, 15), r.randint(2, 9)
    plants = rows * per_row
    tomatoes = plants * per_plant
    question = (
        f"{name} plants {rows} rows of tomato plants with {per_row} plants in each row. Each "
        f"plant gives {per_plant} tomatoes. How many tomatoes does {name} harvest?"
    )
    lines = [
        step(f"{rows} * {per_row}", plants, "There are ", " plants."),
        step(f"{plants} * {per_plant}", tomatoes, f"{name} harvests ", " tomatoes."),
    ]
    return question, lines, tomatoes


def ages(r: random.Random) -> Problem:
    a, b, c = r.sample(NAMES, 3)
    c_age, factor, older = r.randint(3, 12), r.randint(2, 3), r.randint(2, 9)
    b_age = c_age * factor
    a_age = b_age + older
    total = a_age + b_age + c_age
    times = "twice" if factor == 2 else "three times"
    question = (
        f"{c} is {c_age} years old. {b} is {times} as old as {c}, and {a} is {older} years "
        f"older than {b}. What is the sum of their ages?"
    )
    lines = [
        step(f"{c_age} * {factor}", b_age, f"{b} is ", " years old."),
        step(f"{b_age} + {older}", a_age, f"{a} is ", " years old."),
        step(f"{a_age} + {b_age} + {c_age}", total, "Together they are ", " years old."),
    ]
    return question, lines, total


def baking(r: random.Random) -> Problem:
    name, snack = r.choice(NAMES), r.choice(SNACKS)
    cups, batch, batches = r.randint(2, 5), r.choice([12, 18, 24]), r.randint(2, 6)
    wanted = batch * batches
    flour = cups * batches
    question = (
        f"A recipe uses {cups} cups of flour to make {batch} {snack}. {name} wants to make "
        f"{wanted} {snack}. How many cups of flour does {name} need?"
    )
    lines = [
        step(f"{wanted} / {batch}", batches, f"{name} needs ", " batches."),
        step(f"{batches} * {cups}", flour, "That takes ", " cups of flour."),
    ]
    return question, lines, flour


def chores(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    minutes, tasks = r.choice([5, 10, 12, 15, 20, 30]), r.randint(3, 12)
    total = minutes * tasks
    extra = 60 * r.randint(1, 3) - total % 60
    grand = total + extra
    hours = grand // 60
    question = (
        f"{name} has {tasks} chores that take {minutes} minutes each, then spends {extra} "
        f"minutes on homework. How many hours does {name} spend in total?"
    )
    lines = [
        step(f"{tasks} * {minutes}", total, "The chores take ", " minutes."),
        step(f"{total} + {extra}", grand, "With homework that is ", " minutes."),
        step(f"{grand} / 60", hours, "That is ", " hours."),
    ]
    return question, lines, hours


def pet_food(r: random.Random) -> Problem:
    name, pets = r.choice(NAMES), r.choice(PETS)
    count, cups = r.randint(2, 5), r.randint(1, 4)
    per_day = count * cups
    days = r.randint(5, 20)
    bag = per_day * days
    question = (
        f"{name} has {count} {pets}. Each one eats {cups} cups of food a day. A bag holds {bag} "
        f"cups. How many days does one bag last?"
    )
    lines = [
        step(f"{count} * {cups}", per_day, f"The {pets} eat ", " cups a day."),
        step(f"{bag} / {per_day}", days, "The bag lasts ", " days."),
    ]
    return question, lines, days


def tickets(r: random.Random) -> Problem:
    adult, child = r.randint(8, 20), r.randint(3, 7)
    n_adult, n_child = r.randint(20, 120), r.randint(20, 150)
    a_total, c_total = adult * n_adult, child * n_child
    total = a_total + c_total
    event = r.choice(["school play", "concert", "puppet show", "science fair", "talent show"])
    question = (
        f"Tickets to the {event} cost ${adult} for adults and ${child} for children. They sold "
        f"{n_adult} adult tickets and {n_child} child tickets. How much money did they collect?"
    )
    lines = [
        step(f"{adult} * {n_adult}", a_total, "Adult tickets brought in ", " dollars."),
        step(f"{child} * {n_child}", c_total, "Child tickets brought in ", " dollars."),
        step(f"{a_total} + {c_total}", total, "They collected ", " dollars."),
    ]
    return question, lines, total


def flooring(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    length, width, price = r.randint(8, 20), r.randint(6, 15), r.randint(2, 9)
    area = length * width
    cost = area * price
    question = (
        f"{name}'s room is {length} feet long and {width} feet wide. New flooring costs ${price} "
        f"per square foot. How much does it cost to cover the floor?"
    )
    lines = [
        step(f"{length} * {width}", area, "The floor is ", " square feet."),
        step(f"{area} * {price}", cost, "It costs ", " dollars."),
    ]
    return question, lines, cost


def sharing(r: random.Random) -> Problem:
    name, thing = r.choice(NAMES), r.choice(COLLECTIONS)
    part = r.choice([2, 3, 4, 5])
    start = part * r.randint(6, 20)
    given = start // part
    after = start - given
    sister = r.randint(1, after - 1)
    left = after - sister
    question = (
        f"{name} has {start} {thing}. {name} gives 1/{part} of them to a friend and then "
        f"{sister} to a sister. How many {thing} does {name} have left?"
    )
    lines = [
        step(f"{start} / {part}", given, f"{name} gives the friend ", f" {thing}."),
        step(f"{start} - {given}", after, "That leaves ", f" {thing}."),
        step(f"{after} - {sister}", left, f"{name} has ", f" {thing} left."),
    ]
    return question, lines, left


def bus(r: random.Random) -> Problem:
    start = r.randint(10, 40)
    off1, on1 = r.randint(1, start - 1), r.randint(1, 15)
    after1 = start - off1 + on1
    off2, on2 = r.randint(1, after1 - 1), r.randint(0, 12)
    after2 = after1 - off2 + on2
    question = (
        f"A bus leaves the station with {start} passengers. At the first stop {off1} get off and "
        f"{on1} get on. At the second stop {off2} get off and {on2} get on. How many passengers "
        f"are on the bus now?"
    )
    lines = [
        step(f"{start} - {off1} + {on1}", after1, "After the first stop there are ", "."),
        step(f"{after1} - {off2} + {on2}", after2, "After the second stop there are ", "."),
    ]
    return question, lines, after2


def bake_sale(r: random.Random) -> Problem:
    name, s1, s2 = r.choice(NAMES), *r.sample(SNACKS, 2)
    n1, p1, n2, p2 = r.randint(10, 60), r.randint(2, 5), r.randint(10, 60), r.randint(1, 4)
    m1, m2 = n1 * p1, n2 * p2
    income = m1 + m2
    supplies = r.randint(10, income - 1)
    profit = income - supplies
    question = (
        f"At a bake sale {name} sells {n1} {s1} for ${p1} each and {n2} {s2} for ${p2} each. "
        f"The supplies cost ${supplies}. How much profit does {name} make?"
    )
    lines = [
        step(f"{n1} * {p1}", m1, f"The {s1} bring in ", " dollars."),
        step(f"{n2} * {p2}", m2, f"The {s2} bring in ", " dollars."),
        step(f"{m1} + {m2} - {supplies}", profit, "The profit is ", " dollars."),
    ]
    return question, lines, profit


def running(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    weekday, weekend, weeks = r.randint(2, 8), r.randint(4, 15), r.randint(2, 8)
    a, b = 5 * weekday, 2 * weekend
    week = a + b
    total = week * weeks
    question = (
        f"{name} runs {weekday} miles on each weekday and {weekend} miles on each day of the "
        f"weekend. How many miles does {name} run in {weeks} weeks?"
    )
    lines = [
        step(f"5 * {weekday}", a, "On weekdays that is ", " miles."),
        step(f"2 * {weekend}", b, "On the weekend that is ", " miles."),
        step(f"{a} + {b}", week, "Each week is ", " miles."),
        step(f"{week} * {weeks}", total, f"In {weeks} weeks {name} runs ", " miles."),
    ]
    return question, lines, total


def phone_bill(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    base, limit, per_gb = r.randint(15, 40), r.randint(2, 10), r.randint(3, 10)
    used = limit + r.randint(1, 8)
    over = used - limit
    extra = over * per_gb
    bill = base + extra
    question = (
        f"{name}'s phone plan costs ${base} a month and includes {limit} GB of data. Each extra "
        f"GB costs ${per_gb}. {name} used {used} GB this month. How much is the bill?"
    )
    lines = [
        step(f"{used} - {limit}", over, f"{name} used ", " extra GB."),
        step(f"{over} * {per_gb}", extra, "The extra data costs ", " dollars."),
        step(f"{base} + {extra}", bill, "The bill is ", " dollars."),
    ]
    return question, lines, bill


def water_tank(r: random.Random) -> Problem:
    rate, minutes = r.randint(2, 12), r.randint(5, 40)
    already = r.randint(10, 200)
    needed = rate * minutes
    capacity = already + needed
    question = (
        f"A tank holds {capacity} liters and already has {already} liters in it. Water flows in "
        f"at {rate} liters per minute. How many minutes until the tank is full?"
    )
    lines = [
        step(f"{capacity} - {already}", needed, "The tank needs ", " more liters."),
        step(f"{needed} / {rate}", minutes, "That takes ", " minutes."),
    ]
    return question, lines, minutes


def pizza(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    pizzas, slices, each = r.randint(2, 8), r.choice([6, 8, 10, 12]), r.randint(1, 3)
    total = pizzas * slices
    people = r.randint(2, total // each)
    eaten = people * each
    left = total - eaten
    question = (
        f"{name} orders {pizzas} pizzas cut into {slices} slices each. {people} people eat "
        f"{each} slices each. How many slices are left?"
    )
    lines = [
        step(f"{pizzas} * {slices}", total, "There are ", " slices."),
        step(f"{people} * {each}", eaten, "They eat ", " slices."),
        step(f"{total} - {eaten}", left, "There are ", " slices left."),
    ]
    return question, lines, left


def price_rise(r: random.Random) -> Problem:
    name, fruit = r.choice(NAMES), r.choice(FRUITS)
    percent = r.choice([10, 20, 25, 50])
    price = r.randint(1, 12) * 20
    rise = price * percent // 100
    new = price + rise
    count = r.randint(2, 9)
    total = new * count
    question = (
        f"A box of {fruit} cost ${price} last year. This year the price went up by {percent}%. "
        f"{name} buys {count} boxes this year. How much does {name} spend?"
    )
    lines = [
        step(f"{price} * {percent} / 100", rise, "The price went up by ", " dollars."),
        step(f"{price} + {rise}", new, "A box now costs ", " dollars."),
        step(f"{new} * {count}", total, f"{name} spends ", " dollars."),
    ]
    return question, lines, total


def average(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    tests = r.randint(3, 5)
    mean = r.randint(62, 86)
    scores = [mean + r.randint(-3, 3) for _ in range(tests - 1)]
    scores.append(mean * tests - sum(scores))
    total = sum(scores)
    shown = ", ".join(str(s) for s in scores[:-1]) + f" and {scores[-1]}"
    question = f"{name} scored {shown} on {tests} math tests. What is {name}'s average score?"
    lines = [
        step(" + ".join(str(s) for s in scores), total, "The scores add up to ", "."),
        step(f"{total} / {tests}", mean, "The average is ", "."),
    ]
    return question, lines, mean


def collection(r: random.Random) -> Problem:
    name, thing = r.choice(NAMES), r.choice(COLLECTIONS)
    start, weekly, weeks = r.randint(10, 80), r.randint(2, 10), r.randint(2, 10)
    bought = weekly * weeks
    total = start + bought
    if total % 2:
        start, total = start + 1, total + 1
    kept = total // 2
    question = (
        f"{name} has {start} {thing} and buys {weekly} more every week for {weeks} weeks. Then "
        f"{name} gives half of the collection to a cousin. How many {thing} does {name} keep?"
    )
    lines = [
        step(f"{weekly} * {weeks}", bought, f"{name} buys ", f" {thing}."),
        step(f"{start} + {bought}", total, f"{name} then has ", f" {thing}."),
        step(f"{total} / 2", kept, f"{name} keeps ", f" {thing}."),
    ]
    return question, lines, kept


def comparison(r: random.Random) -> Problem:
    a, b, c = r.sample(NAMES, 3)
    fruit = r.choice(FRUITS)
    x, times, fewer = r.randint(3, 20), r.randint(2, 4), r.randint(1, 9)
    b_count = x * times
    c_count = b_count - fewer
    total = x + b_count + c_count
    question = (
        f"{a} has {x} {fruit}. {b} has {times} times as many {fruit} as {a}, and {c} has "
        f"{fewer} fewer than {b}. How many {fruit} do they have altogether?"
    )
    lines = [
        step(f"{x} * {times}", b_count, f"{b} has ", f" {fruit}."),
        step(f"{b_count} - {fewer}", c_count, f"{c} has ", f" {fruit}."),
        step(f"{x} + {b_count} + {c_count}", total, "Altogether they have ", f" {fruit}."),
    ]
    return question, lines, total


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    shopping, farm_sales, reading, road_trip, wages, discount, classroom, savings, garden, ages,
    baking, chores, pet_food, tickets, flooring, sharing, bus, bake_sale, running, phone_bill,
    water_tank, pizza, price_rise, average, collection, comparison,
]  # fmt: skip


def generate(count: int = COUNT, seed: int = SEED) -> list[dict[str, str]]:
    """`count` distinct problems, templates taken in turn so every kind is equally represented."""
    rng = random.Random(seed)
    problems, seen = [], set()
    index = 0
    while len(problems) < count:
        question, lines, final = TEMPLATES[index % len(TEMPLATES)](rng)
        index += 1
        if question in seen:
            continue
        seen.add(question)
        problems.append({"question": question, "answer": "\n".join([*lines, f"#### {final}"])})
    return problems


def main() -> None:
    with OUT.open("w", encoding="utf-8") as out:
        for problem in generate():
            out.write(json.dumps(problem, ensure_ascii=False) + "\n")
    print(f"wrote {COUNT} problems to {OUT}")


if __name__ == "__main__":
    main()
