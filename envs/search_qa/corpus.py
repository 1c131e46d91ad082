"""The bundled corpus and questions of search-qa, generated from a fixed seed.

A fictional world (countries, cities, people, companies, with made-up names), so no model can
answer from memory: every question needs two or three searches, each finding the entity that
the next search is about (Search-R1/HotpotQA-style bridge questions). `documents()` and
`questions()` are pure functions of `WORLD_SEED`; the same corpus on every machine.

Each question type has a *chain*: per hop, a search query and a pattern that pulls the next
entity out of the retrieved text. The demonstration policy follows the chain reading the real
search results, so a full-reward demonstration proves the index retrieves what the question needs.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

WORLD_SEED = 20240611
SYLLABLES = (
    "ka lo mi ren tor va sel dun bri os el fa gor hin ja ku lis mor nel pa qui ras sto tam ul vek "
    "wen yar zo bel cas dor ith mar nov pel riv sun tal ver"
).split()
PROFESSIONS = (
    "painter",
    "engineer",
    "chemist",
    "sailor",
    "baker",
    "architect",
    "poet",
    "surgeon",
    "judge",
)
INDUSTRIES = (
    "shipping",
    "software",
    "textile",
    "mining",
    "brewing",
    "publishing",
    "aerospace",
    "fishing",
)
CURRENCIES = ("mark", "crown", "florin", "dinar", "shell", "talon")


@dataclass(frozen=True)
class Hop:
    query: str
    """Search query; `{0}` is the question's entity, `{i}` what hop i found."""
    pattern: str
    """Regex (after `{i}` substitution with escaped values) whose group 1 is what this hop finds."""


PERSON_BORN = Hop("{0} born", r"{0} is an? [a-z]+ who was born in (\w+)")
CITY_COUNTRY = Hop("{1} city", r"{1} is a city in (\w+)")
CHAINS: dict[str, tuple[Hop, ...]] = {
    "birth_country": (PERSON_BORN, CITY_COUNTRY),
    "birth_capital": (
        PERSON_BORN,
        CITY_COUNTRY,
        Hop("{2} capital", r"{2} is a country whose capital is (\w+)"),
    ),
    "founder_birthplace": (
        Hop("{0} company founded", r"{0} is an? [a-z]+ company founded by ([A-Z]\w+ [A-Z]\w+)"),
        Hop("{1} born", r"{1} is an? [a-z]+ who was born in (\w+)"),
    ),
    "hq_country": (
        Hop("{0} headquarters", r"{0} is an? [a-z]+ company .*?Its headquarters are in (\w+)"),
        CITY_COUNTRY,
    ),
}
QUESTIONS = {
    "birth_country": "In which country was {0} born?",
    "birth_capital": "What is the capital of the country where {0} was born?",
    "founder_birthplace": "In which city was the founder of {0} born?",
    "hq_country": "In which country are the headquarters of {0}?",
}


class _Names:
    """Unique made-up words (never reused, so every name is its own search term)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def __call__(self, lo: int = 2, hi: int = 3) -> str:
        while True:
            word = "".join(
                self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(lo, hi))
            ).capitalize()
            if word not in self.used and len(word) > 3:
                self.used.add(word)
                return word


@functools.cache
def world() -> dict[str, Any]:
    rng = random.Random(WORLD_SEED)
    name = _Names(rng)
    countries = [name() for _ in range(10)]
    cities = [
        {"name": name(), "country": countries[i % len(countries)], "river": name()}
        for i in range(40)
    ]
    capitals = {c: next(x["name"] for x in cities if x["country"] == c) for c in countries}
    people = [
        {"name": f"{name(2, 2)} {name()}", "profession": rng.choice(PROFESSIONS),
         "city": rng.choice(cities)["name"], "year": rng.randint(1850, 1990)}
        for _ in range(120)
    ]  # fmt: skip
    companies = [
        {"name": name(3, 3), "industry": rng.choice(INDUSTRIES),
         "founder": rng.choice(people)["name"], "city": rng.choice(cities)["name"],
         "year": rng.randint(1900, 2020)}
        for _ in range(40)
    ]  # fmt: skip
    currency = {c: rng.choice(CURRENCIES) for c in countries}
    return {"countries": countries, "capitals": capitals, "currency": currency, "cities": cities,
            "people": people, "companies": companies}  # fmt: skip


@functools.cache
def documents() -> tuple[str, ...]:
    """The corpus: one short article per entity. Only city articles use the word "city"."""
    w = world()
    docs = [
        f"{c} is a country whose capital is {w['capitals'][c]}. "
        f"Its currency is the {w['currency'][c]}."
        for c in w["countries"]
    ]
    docs += [
        f"{c['name']} is a city in {c['country']}, on the banks of the {c['river']} river."
        for c in w["cities"]
    ]
    docs += [
        f"{p['name']} is {_a(p['profession'])} who was born in {p['city']} in {p['year']}."
        for p in w["people"]
    ]
    docs += [
        f"{c['name']} is {_a(c['industry'])} company founded by {c['founder']} in {c['year']}. "
        f"Its headquarters are in {c['city']}."
        for c in w["companies"]
    ]
    return tuple(docs)


@functools.cache
def questions() -> tuple[dict[str, Any], ...]:
    """Every question with its answer and the gold bridge entities (`path`)."""
    w = world()
    country_of = {c["name"]: c["country"] for c in w["cities"]}
    born_in = {p["name"]: p["city"] for p in w["people"]}
    out: list[dict[str, Any]] = []

    def add(kind: str, entity: str, path: list[str]) -> None:
        out.append(
            {
                "id": f"search-qa-{kind}-{entity.replace(' ', '_')}",
                "type": kind,
                "entity": entity,
                "question": QUESTIONS[kind].format(entity),
                "answer": path[-1],
                "path": path,
            }
        )

    for p in w["people"]:
        city = p["city"]
        add("birth_country", p["name"], [city, country_of[city]])
        add("birth_capital", p["name"], [city, country_of[city], w["capitals"][country_of[city]]])
    for c in w["companies"]:
        add("founder_birthplace", c["name"], [c["founder"], born_in[c["founder"]]])
        add("hq_country", c["name"], [c["city"], country_of[c["city"]]])
    return tuple(out)


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word
