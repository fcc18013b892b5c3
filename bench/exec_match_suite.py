"""A varied suite of (predicted, gold) pairs and the database they run on, with the official evaluator's verdicts.

Shared by `tests/test_exec_match.py` (our verdicts must equal these) and `bench/exec_match_vs_official.py` (which
re-derives each verdict with the official code, then times both).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA = """
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER);
CREATE TABLE orders (id INTEGER PRIMARY KEY, product_id INTEGER REFERENCES products(id), customer TEXT, qty INTEGER);
CREATE TABLE "商品" ("名称" TEXT, "价格" REAL);
INSERT INTO products (name, category, price, stock) VALUES
  ('pen', 'office', 2.5, 100), ('desk', 'furniture', 120.0, 5), ('lamp', 'furniture', 35.0, NULL),
  ('ink', 'office', 2.5, 40), ('chair', 'furniture', 80.25, 12), ('mug', NULL, 7.1, 30);
INSERT INTO orders (product_id, customer, qty) VALUES
  (1, 'ann', 3), (1, 'bob', 1), (2, 'ann', 1), (3, 'cid', 2), (5, 'bob', 4), (5, 'bob', 1);
INSERT INTO "商品" VALUES ('笔', 2.5), ('桌子', 120.0);
"""

# (predicted, gold, official verdict with keep_distinct=False, plug_value=False)
CASES: list[tuple[str, str, int]] = [
    ("SELECT name FROM products", "SELECT name FROM products", 1),
    ("select NAME from PRODUCTS", "SELECT name FROM products", 1),
    ("SELECT price, name FROM products", "SELECT name, price FROM products", 1),  # columns permuted
    ("SELECT name, price, stock, category FROM products", "SELECT category, stock, name, price FROM products", 1),
    ("SELECT name FROM products ORDER BY price", "SELECT name FROM products", 1),  # order ignored
    ("SELECT name FROM products ORDER BY price DESC", "SELECT name FROM products ORDER BY price ASC", 0),
    ("SELECT name FROM products ORDER BY price DESC, name", "SELECT name FROM products ORDER BY price DESC, name", 1),
    ("SELECT DISTINCT price FROM products WHERE price < 3", "SELECT price FROM products WHERE price < 3", 1),
    ("SELECT DISTINCT customer FROM orders", "SELECT customer FROM orders", 1),  # DISTINCT dropped: 6 rows each
    ("SELECT count(DISTINCT customer) FROM orders", "SELECT count(customer) FROM orders", 1),  # both lose DISTINCT
    ("SELECT max(price) FROM products", "SELECT price FROM products ORDER BY price DESC LIMIT 1", 1),
    (
        "SELECT name FROM products ORDER BY price DESC LIMIT 2",
        "SELECT name FROM products ORDER BY price DESC LIMIT 3",
        0,
    ),
    ("SELECT name FROM products LIMIT 2", "SELECT name FROM products LIMIT 2", 1),
    ("SELECT avg(price) FROM products", "SELECT sum(price) / count(*) FROM products", 1),
    ("SELECT avg(price) FROM products", "SELECT sum(price) / count(price) + 0.0001 FROM products", 0),
    ("SELECT count(*) FROM products WHERE stock IS NULL", "SELECT count(*) FROM products WHERE stock IS NULL", 1),
    ("SELECT stock FROM products", "SELECT stock FROM products WHERE stock IS NOT NULL", 0),  # NULL row
    (
        "SELECT category, count(*) FROM products GROUP BY category",
        "SELECT category, count(*) FROM products GROUP BY category",
        1,
    ),
    (
        "SELECT count(*), category FROM products GROUP BY category",
        "SELECT category, count(*) FROM products GROUP BY category",
        1,
    ),
    ("SELECT 2.50", "SELECT 2.5", 1),
    ("SELECT 2.5", "SELECT '2.5'", 0),  # float vs text
    (
        "SELECT T1.name FROM products AS T1 JOIN orders AS T2 ON T1.id = T2.product_id WHERE T2.customer = 'bob'",
        "SELECT name FROM products WHERE id IN (SELECT product_id FROM orders WHERE customer = 'bob')",
        0,
    ),  # bag
    (
        "SELECT T1.name FROM products AS T1 JOIN orders AS T2 ON T1.id = T2.product_id WHERE T2.qty > = 2",
        "SELECT T1.name FROM products AS T1 JOIN orders AS T2 ON T1.id = T2.product_id WHERE T2.qty >= 2",
        1,
    ),
    ("SELECT name FROM products WHERE price > 100", "SELECT name FROM products WHERE price > 30", 0),
    ("SELEC name FROM products", "SELECT name FROM products", 0),
    ("SELECT name FROM nowhere", "SELECT name FROM products", 0),
    ("SELECT name FROM products WHERE price > 1000", "SELECT name FROM products WHERE stock > 1000", 1),  # both empty
    ('SELECT "名称" FROM "商品" WHERE "价格" > 3', 'SELECT "名称" FROM "商品" WHERE "价格" > 100', 1),
    ('SELECT "名称" FROM "商品"', 'SELECT "名称" FROM "商品" WHERE "价格" < 3', 0),
]


def build_database(directory: Path) -> Path:
    """`directory/shop/shop.sqlite` (Spider's layout: one database per folder, as the official evaluator expects)."""
    path = directory / "shop" / "shop.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        conn = sqlite3.connect(path)
        conn.executescript(SCHEMA)
        conn.commit()
        conn.close()
    return path
