"""A stand-in for a paid model call (configs/paid/pipeline.toml): it reports what it
used, and the first attempt of every third item is refused by the "provider" for its
rate, asking to be retried after a second. Group P2's answers are more useful per
dollar than P3's, which the run's selection learns from the reported usage."""

import json
import os
import sys

item, group = sys.argv[1], sys.argv[2]
result = {"job_id": os.environ["LANEWAY_JOB_ID"]}
if int(item.rsplit("-", 1)[1]) % 3 == 0 and os.environ["LANEWAY_ATTEMPT"] == "1":
    result |= {"rate_limited": True, "retry_after_seconds": 1}
else:
    useful = {"P2": 900, "P3": 300}[group]
    result["usage"] = {"useful_tokens": useful, "cost_usd": 0.1}
    print(f"{item}: {useful} useful tokens")
with open(os.environ["LANEWAY_RESULT_PATH"], "w") as out:
    json.dump(result, out)
