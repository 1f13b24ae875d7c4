"""The built-in sql_db database: a small retail chain, generated deterministically.

    from envs.sql_db.database import default_db_path
    path = default_db_path()   # $AGENTOPD_HOME/envs/sql_db/default.db, built on first use

Tables (built with sqlite-utils from a fixed seed, so every machine gets the same rows):

    stores(id, name, city, opened_year)                                        8 rows
    employees(id, name, store_id -> stores, role, hire_year, salary)          48 rows
    customers(id, name, email, city, signup_year)                            400 rows
    products(id, name, category, price)                                       80 rows
    orders(id, customer_id, store_id, employee_id, order_date, status)     1,500 rows
    order_items(id, order_id, product_id, quantity, unit_price)           ~3,750 rows

Names are unique within a table and contain no quotes, so a question's entity can be
pasted into SQL as is. The file is built into a temporary file and renamed into place,
and rebuilt when missing or when its `PRAGMA user_version` differs from `DB_VERSION`.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import tempfile
from pathlib import Path

import sqlite_utils

from agentopd.env import seeded_rng
from agentopd.paths import agentopd_home

DB_VERSION = 1  # bump when the generator changes: cached files are rebuilt
DB_SEED = 20240611

FIRST_NAMES = (
    "James Mary Robert Patricia John Jennifer Michael Linda David Elizabeth William Barbara Richard Susan "
    "Joseph Jessica Thomas Sarah Charles Karen Daniel Lisa Matthew Nancy Anthony Betty Mark Sandra Donald "
    "Ashley Steven Emily Paul Kimberly Andrew Donna Joshua Michelle Kenneth Carol Kevin Amanda Brian Melissa "
    "George Deborah Timothy Stephanie Ronald Rebecca Jason Laura Edward Helen Ryan Sharon Jacob Cynthia"
).split()
LAST_NAMES = (
    "Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez Gonzalez "
    "Wilson Anderson Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris Sanchez Clark "
    "Ramirez Lewis Robinson Walker Young Allen King Wright Scott Torres Nguyen Hill Flores Green Adams "
    "Nelson Baker Hall Rivera Campbell Mitchell Carter Roberts Gomez Phillips Evans Turner Diaz Parker"
).split()
CITIES = (
    "Boston", "Chicago", "Denver", "Seattle", "Austin", "Portland", "Atlanta", "Phoenix", "Miami", "Dallas",
    "Houston", "Nashville", "Detroit", "Minneapolis", "San Diego", "Philadelphia", "Baltimore", "Pittsburgh",
    "Sacramento", "Orlando",
)  # fmt: skip
STORES = (
    ("Boston Downtown", "Boston"), ("Chicago Loop", "Chicago"), ("Denver Union", "Denver"),
    ("Seattle Harbor", "Seattle"), ("Austin Central", "Austin"), ("Atlanta Midtown", "Atlanta"),
    ("Miami Beach", "Miami"), ("Portland Pearl", "Portland"),
)  # fmt: skip
ROLES = ("Manager", "Sales Associate", "Sales Associate", "Cashier", "Cashier", "Stock Clerk")
PRODUCTS: dict[str, tuple[tuple[int, int], tuple[str, ...]]] = {  # category: (price range in dollars, names)
    "Electronics": ((15, 300), ("Wireless Mouse", "Mechanical Keyboard", "USB-C Cable", "Bluetooth Speaker",
        "Noise Cancelling Headphones", "Webcam", "Portable Charger", "Smart Watch", "LED Monitor", "Wireless Earbuds")),
    "Kitchen": ((10, 200), ("Chef Knife", "Cast Iron Skillet", "Coffee Grinder", "French Press", "Cutting Board",
        "Stand Mixer", "Toaster", "Electric Kettle", "Blender", "Rice Cooker")),
    "Garden": ((5, 150), ("Garden Hose", "Pruning Shears", "Watering Can", "Flower Pots", "Lawn Rake",
        "Seed Starter Kit", "Garden Gloves", "Leaf Blower", "Compost Bin", "Bird Feeder")),
    "Sports": ((8, 160), ("Yoga Mat", "Dumbbell Set", "Tennis Racket", "Basketball", "Soccer Ball", "Jump Rope",
        "Resistance Bands", "Cycling Helmet", "Running Shoes", "Water Bottle")),
    "Office": ((3, 250), ("Desk Lamp", "Office Chair", "Stapler", "Notebook Pack", "Gel Pens", "Desk Organizer",
        "Whiteboard", "Paper Shredder", "Label Maker", "File Cabinet")),
    "Toys": ((6, 120), ("Building Blocks", "Jigsaw Puzzle", "Remote Control Car", "Board Game", "Plush Bear",
        "Toy Train Set", "Art Kit", "Kite", "Doll House", "Science Kit")),
    "Home": ((7, 180), ("Throw Pillow", "Wall Clock", "Scented Candle", "Bath Towel Set", "Table Lamp", "Area Rug",
        "Picture Frame", "Storage Basket", "Curtain Panels", "Laundry Hamper")),
    "Outdoors": ((12, 350), ("Camping Tent", "Sleeping Bag", "Hiking Backpack", "Headlamp", "Camp Stove",
        "Trekking Poles", "Cooler", "Hammock", "Water Filter", "Folding Chair")),
}  # fmt: skip
STATUSES = ("delivered", "shipped", "cancelled", "returned")
STATUS_WEIGHTS = (0.75, 0.1, 0.08, 0.07)
ORDER_YEARS = (2022, 2023, 2024)
NUM_CUSTOMERS = 400
NUM_ORDERS = 1500


def default_db_path() -> Path:
    """The generated database, built (atomically) when missing or stale."""
    path = agentopd_home() / "envs" / "sql_db" / "default.db"
    if not _is_current(path):
        build_database(path)
    return path


def _is_current(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True) as conn:
            return conn.execute("PRAGMA user_version").fetchone()[0] == DB_VERSION
    except sqlite3.Error:
        return False


def build_database(path: Path) -> None:
    """Generate the database into a temporary file next to `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".default-", suffix=".db", dir=path.parent)
    os.close(fd)
    try:
        db = sqlite_utils.Database(tmp)
        _fill(db)
        db.execute(f"PRAGMA user_version = {DB_VERSION}")
        db.conn.commit()
        db.execute("VACUUM")
        db.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _unique_names(rng, n: int, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = f"{FIRST_NAMES[rng.integers(len(FIRST_NAMES))]} {LAST_NAMES[rng.integers(len(LAST_NAMES))]}"
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def _price(rng, low: int, high: int) -> float:
    dollars = int(rng.integers(low, high))
    return dollars + float(rng.choice([0.99, 0.49, 0.0, 0.95, 0.5]))


def _fill(db: sqlite_utils.Database) -> None:
    rng = seeded_rng(DB_SEED)
    taken: set[str] = set()
    stores = [
        {"id": i + 1, "name": name, "city": city, "opened_year": int(rng.integers(2005, 2020))}
        for i, (name, city) in enumerate(STORES)
    ]
    employees = []
    for store in stores:
        for role, name in zip(ROLES, _unique_names(rng, len(ROLES), taken), strict=True):
            base = {"Manager": 72000, "Sales Associate": 41000, "Cashier": 33000, "Stock Clerk": 31000}[role]
            employees.append({
                "id": len(employees) + 1, "name": name, "store_id": store["id"], "role": role,
                "hire_year": int(rng.integers(max(store["opened_year"], 2012), 2025)),
                "salary": base + 500 * int(rng.integers(0, 20)),
            })  # fmt: skip
    city_weights = rng.uniform(0.5, 2.0, len(CITIES))
    city_weights /= city_weights.sum()
    customers = []
    for name in _unique_names(rng, NUM_CUSTOMERS, taken):
        customers.append({
            "id": len(customers) + 1, "name": name, "email": name.lower().replace(" ", ".") + "@example.com",
            "city": CITIES[rng.choice(len(CITIES), p=city_weights)], "signup_year": int(rng.integers(2018, 2025)),
        })  # fmt: skip
    products = []
    for category, ((low, high), names) in PRODUCTS.items():
        for name in names:
            products.append({"id": len(products) + 1, "name": name, "category": category, "price": _price(rng, low, high)})
    popularity = rng.uniform(0.2, 3.0, len(products))
    popularity /= popularity.sum()
    activity = rng.gamma(2.0, 1.0, len(customers))
    activity /= activity.sum()
    store_of_city = {s["city"]: s for s in stores}
    staff = {s["id"]: [e["id"] for e in employees if e["store_id"] == s["id"] and e["role"] != "Stock Clerk"] for s in stores}
    first_day = dt.date(ORDER_YEARS[0], 1, 1)
    num_days = (dt.date(ORDER_YEARS[-1], 12, 31) - first_day).days + 1
    orders, items = [], []
    for order_id in range(1, NUM_ORDERS + 1):
        customer = customers[rng.choice(len(customers), p=activity)]
        local = store_of_city.get(customer["city"])
        store = local if local is not None and rng.random() < 0.8 else stores[rng.integers(len(stores))]
        staff_ids = staff[store["id"]]
        orders.append({
            "id": order_id, "customer_id": customer["id"], "store_id": store["id"],
            "employee_id": staff_ids[rng.integers(len(staff_ids))],
            "order_date": (first_day + dt.timedelta(days=int(rng.integers(num_days)))).isoformat(),
            "status": STATUSES[rng.choice(len(STATUSES), p=STATUS_WEIGHTS)],
        })  # fmt: skip
        for p in rng.choice(len(products), size=int(rng.integers(1, 5)), replace=False, p=popularity):
            product = products[p]
            items.append({
                "id": len(items) + 1, "order_id": order_id, "product_id": product["id"],
                "quantity": int(rng.integers(1, 6)), "unit_price": product["price"],
            })  # fmt: skip
    db["stores"].insert_all(stores, pk="id")
    db["employees"].insert_all(employees, pk="id", foreign_keys=[("store_id", "stores", "id")])
    db["customers"].insert_all(customers, pk="id")
    db["products"].insert_all(products, pk="id")
    db["orders"].insert_all(
        orders,
        pk="id",
        foreign_keys=[("customer_id", "customers", "id"), ("store_id", "stores", "id"), ("employee_id", "employees", "id")],
    )
    db["order_items"].insert_all(
        items, pk="id", foreign_keys=[("order_id", "orders", "id"), ("product_id", "products", "id")]
    )
    for table, columns in (
        ("employees", ["store_id"]), ("employees", ["name"]), ("customers", ["name"]), ("customers", ["city"]),
        ("products", ["name"]), ("products", ["category"]), ("orders", ["customer_id"]), ("orders", ["store_id"]),
        ("orders", ["employee_id"]), ("orders", ["order_date"]), ("order_items", ["order_id"]),
        ("order_items", ["product_id"]),
    ):  # fmt: skip
        db[table].create_index(columns)
    db.analyze()
