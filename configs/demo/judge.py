"""Demo stage 3: judge an answer. Item i11's answer is rejected: an ordinary failure."""

import sys

from demo_job import work, write_result

item = sys.argv[1]
work(0.2)
if item == "i11":
    print(f"judge: {item} rejected (wrong answer)")
    write_result(item=item, verdict="rejected")
    sys.exit(1)
print(f"judge: {item} accepted")
write_result(item=item, verdict="accepted")
