"""Demo stage 1: prepare an item (no paid calls)."""

import sys

from demo_job import work, write_result

item, difficulty = sys.argv[1], sys.argv[2]
print(f"preparing {item} ({difficulty})")
work(0.3)
write_result(item=item, difficulty=difficulty, prepared=True)
