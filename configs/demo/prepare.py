"""Demo stage 1: prepare an item's packet (no paid calls); solve gets it as an input."""

import sys

from demo_job import work, write_output, write_result

item, difficulty = sys.argv[1], sys.argv[2]
print(f"preparing {item} ({difficulty})")
work(0.3)
write_output("packet.json", {"item": item, "difficulty": difficulty, "prompt": f"solve {item}"})
write_result(item=item, difficulty=difficulty, prepared=True)
