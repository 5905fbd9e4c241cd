"""Demo stage 3: judge solve's answer.json. Item i05's answer is rejected: an ordinary failure."""

import sys

from demo_job import read_input, work, write_result

item, answer = sys.argv[1], read_input(sys.argv[2])
if answer["item"] != item:
    raise SystemExit(f"judge: {item} was handed the answer for {answer['item']}")
work(0.2)
if item == "i05":
    print(f"judge: {item} rejected (wrong answer)")
    write_result(item=item, verdict="rejected")
    sys.exit(1)
print(f"judge: {item} accepted")
write_result(item=item, verdict="accepted")
