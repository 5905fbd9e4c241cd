"""Demo stage 2: solve an item's packet (prepare's output) with one paid provider call;
its answer.json goes on to judge.

Item i07 meets a provider outage before any call is billed: it reports an
infrastructure failure (result flag and exit code 75), which is not the job's fault.

Each call reports its usage in the result (simulated tokens by difficulty, a flat
$0.25 a call): laneway records it per attempt, holds the run to its budget with it, and
`laneway report` sums it.
"""

import os
import sys

from demo_job import paid_call, read_input, work, write_output, write_result

PRICE_PER_CALL = 0.25
TOKENS = {"easy": (300, 120), "medium": (600, 250), "hard": (1200, 500)}
"""Simulated (input, output) tokens of one call by difficulty."""

item, packet = sys.argv[1], read_input(sys.argv[2])
if item == "i07":
    print("provider returned 503 before accepting the request; nothing billed", file=sys.stderr)
    usage = {"calls": 0, "cost_usd": 0.0}  # refused before billing: nothing spent
    write_result(item=item, infrastructure_failure=True, provider_status=503, usage=usage)
    sys.exit(75)
# What a real client might log: laneway redacts the credential as the log is written.
print(f"POST /v1/solve Authorization: Bearer {os.environ['DEMO_API_KEY']}", file=sys.stderr)
answer = paid_call(str(packet["prompt"]))
work(0.4)
print(f"solved {item}: {answer}")
write_output("answer.json", {"item": item, "difficulty": packet["difficulty"], "answer": answer})
tokens_in, tokens_out = TOKENS.get(str(packet["difficulty"]), (600, 250))
usage = {
    "calls": 1,
    "input_tokens": tokens_in,
    "output_tokens": tokens_out,
    "useful_tokens": tokens_out,
    "cost_usd": PRICE_PER_CALL,
}
write_result(item=item, answer=answer, usage=usage)
