"""python -m planner.schemas docs/schemas: write docs/schemas/NAME.schema.json."""

import sys

from planner.schemas import write_schemas

if __name__ == "__main__":
    for p in write_schemas(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas"):
        print(p)
