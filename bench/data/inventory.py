import csv
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    price: float


def load_items(path):
    items = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            items.append(Item(row["sku"], row["name"], int(row["quantity"]), float(row["price"])))
    return items


def total_value(items):
    total = 0.0
    for item in items:
        total += item.quantity * item.price
    return total


def low_stock(items, threshold=5):
    result = []
    for item in items:
        if item.quantity < threshold:
            result.append(item)
    return result


def restock(items, sku, amount):
    for item in items:
        if item.sku == sku:
            item.quantity += amount
            return item
    raise KeyError(sku)


def save_report(items, path):
    report = {
        "count": len(items),
        "total_value": round(total_value(items), 2),
        "low_stock": [item.sku for item in low_stock(items)],
    }
    Path(path).write_text(json.dumps(report, indent=2))
    return report


def main():
    items = load_items("inventory.csv")
    print("items:", len(items))
    print("total value:", round(total_value(items), 2))
    for item in low_stock(items):
        print("low stock:", item.sku, item.name, item.quantity)
    save_report(items, "report.json")


if __name__ == "__main__":
    main()
