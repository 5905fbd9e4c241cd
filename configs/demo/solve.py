"""Demo stage 2: solve an item's packet (prepare's output) with one paid provider call;
its answer.json goes on to judge.

Item i07 meets a provider outage before any call is billed: it reports an
infrastructure failure (result flag and exit code 75), which is not the job's fault.
"""

import os
import sys

from demo_job import paid_call, read_input, work, write_output, write_result

item, packet = sys.argv[1], read_input(sys.argv[2])
if item == "i07":
    print("provider returned 503 before accepting the request; nothing billed", file=sys.stderr)
    write_result(item=item, infrastructure_failure=True, provider_status=503)
    sys.exit(75)
# What a real client might log: laneway redacts the credential as the log is written.
print(f"POST /v1/solve Authorization: Bearer {os.environ['DEMO_API_KEY']}", file=sys.stderr)
answer = paid_call(str(packet["prompt"]))
work(0.4)
print(f"solved {item}: {answer}")
write_output("answer.json", {"item": item, "difficulty": packet["difficulty"], "answer": answer})
write_result(item=item, answer=answer)
