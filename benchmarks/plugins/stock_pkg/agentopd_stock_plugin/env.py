"""StockEnv: how many of an item a city's store holds, found with two dependent tool calls; ShelfEnv: the same
with a third (the item's shelf in that store, then the count on that shelf).

    find_store(city)           -> the store's code, e.g. "K-417" (random per city: copied from the tool's output)
    count_stock(store, item)   -> how many it holds (random per store and item: the answer is copied from the output)

The oracle calls both and answers the count. Every (city, item) pair is a task; agentopd holds 20% of them out by a
hash of their ids, so a held-out count can only be read from the tool, never remembered.
"""

from __future__ import annotations

from agentopd.env import Action, Task, ToolEnv, seeded_rng
from agentopd.tool import ToolError

CITIES = """Oslo Lima Kyiv Cairo Dakar Quito Hanoi Perth Turin Porto Split Bergen Leeds Lyon Graz Ghent Malmo Tartu
Riga Vilnius Brno Cork Bilbao Nantes Basel Bremen Gdansk Zadar Varna Izmir Tunis Fez Accra Lagos Mombasa Pune Kochi
Osaka Busan Cebu""".split()
ITEMS = """apples pears lamps chairs kettles towels candles mugs plates spoons forks knives jars brooms buckets
ropes nails hammers ladders gloves""".split()


def _database(seed: int) -> tuple[dict[str, str], dict[tuple[str, str], int]]:
    rng = seeded_rng(seed)
    codes = rng.choice(900, size=len(CITIES), replace=False) + 100
    stores = {city: f"K-{code}" for city, code in zip(CITIES, codes, strict=True)}
    counts = {(stores[c], item): int(rng.integers(1, 100)) for c in CITIES for item in ITEMS}
    return stores, counts


class StockEnv(ToolEnv):
    """Count an item in a city's store: find_store, then count_stock, then the number."""

    name = "stock_lookup"

    def __init__(self, max_turns: int = 4, seed: int = 0):
        self.stores, self.counts = _database(seed)
        tasks = [Task(id=f"{city}-{item}", question=f"How many {item} does the {city} store have?",
                      answer=str(self.counts[(self.stores[city], item)]), data={"city": city, "item": item})
                 for city in CITIES for item in ITEMS]  # fmt: skip
        super().__init__(tasks, max_turns=max_turns)

    def tools(self):
        return [self.find_store, self.count_stock]

    def find_store(self, city: str) -> str:
        """Find the code of the store in a city.

        Args:
            city: The city's name, e.g. "Oslo".
        """
        if city not in self.stores:
            raise ToolError(f"no store in {city[:40]!r}")
        return self.stores[city]

    def count_stock(self, store: str, item: str) -> str:
        """Count how many of an item a store holds.

        Args:
            store: The store's code, as find_store gives it.
            item: The item, e.g. "apples".
        """
        if (store, item) not in self.counts:
            raise ToolError(f"no {item[:40]!r} in store {store[:40]!r}")
        return str(self.counts[(store, item)])

    def system_prompt(self) -> str:
        return "You answer stock questions. Call find_store for the city, then count_stock, then reply with the number only."

    def grade(self, task: Task, answer: str) -> float:
        return float(answer.strip() == task.answer)

    def oracle(self, task: Task) -> list[Action]:
        city, item = task.data["city"], task.data["item"]
        store = self.stores[city]
        return [
            {"role": "assistant", "content": "", "tool_calls": [{"name": "find_store", "arguments": {"city": city}}]},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "count_stock", "arguments": {"store": store, "item": item}}]},
            {"role": "assistant", "content": task.answer},
        ]


class ShelfEnv(StockEnv):
    """Count an item in a city's store with three dependent calls: find_store, find_shelf, count_shelf, then the number."""

    name = "stock_shelves"

    def __init__(self, max_turns: int = 4, seed: int = 0):
        super().__init__(max_turns=max_turns, seed=seed)
        rng = seeded_rng(seed + 1)
        self.shelves = {}  # (store, item) -> its shelf, distinct within a store
        for store in self.stores.values():
            numbers = rng.choice(90, size=len(ITEMS), replace=False) + 10
            self.shelves |= {(store, item): f"S{n}" for item, n in zip(ITEMS, numbers, strict=True)}

    def tools(self):
        return [self.find_store, self.find_shelf, self.count_shelf]

    def find_shelf(self, store: str, item: str) -> str:
        """Find the shelf of an item in a store.

        Args:
            store: The store's code, as find_store gives it.
            item: The item, e.g. "apples".
        """
        if (store, item) not in self.shelves:
            raise ToolError(f"no {item[:40]!r} in store {store[:40]!r}")
        return self.shelves[(store, item)]

    def count_shelf(self, store: str, shelf: str) -> str:
        """Count the items on a shelf of a store.

        Args:
            store: The store's code, as find_store gives it.
            shelf: The shelf, as find_shelf gives it.
        """
        for (s, item), code in self.shelves.items():
            if s == store and code == shelf:
                return str(self.counts[(s, item)])
        raise ToolError(f"no shelf {shelf[:40]!r} in store {store[:40]!r}")

    def system_prompt(self) -> str:
        return ("You answer stock questions. Call find_store for the city, then find_shelf, then count_shelf, then reply "
                "with the number only.")

    def oracle(self, task: Task) -> list[Action]:
        city, item = task.data["city"], task.data["item"]
        store = self.stores[city]
        shelf = self.shelves[(store, item)]
        return [
            {"role": "assistant", "content": "", "tool_calls": [{"name": "find_store", "arguments": {"city": city}}]},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "find_shelf", "arguments": {"store": store, "item": item}}]},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "count_shelf", "arguments": {"store": store, "shelf": shelf}}]},
            {"role": "assistant", "content": task.answer},
        ]
