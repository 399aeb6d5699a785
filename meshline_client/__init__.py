"""The Meshline Python client: typed calls to the gRPC services, without touching stubs.

```
from meshline_client import Connection, InferenceClient, JobsClient

inference = InferenceClient(Connection("127.0.0.1:50054", token="..."))
print(inference.generate("The model", max_new_tokens=16).text)
```

Every call has a deadline (`Connection.timeout_s`, or per call); calls that fail with
UNAVAILABLE are retried by gRPC's own retry policy (service config, `Connection.max_attempts`).
"""

from meshline_client.connection import Connection
from meshline_client.inference import (
    Completion,
    InferenceClient,
    ModelInfo,
    Score,
    StreamDelta,
    TopLogprob,
)
from meshline_client.jobs import JobFailed, JobsClient

__all__ = [
    "Completion",
    "Connection",
    "InferenceClient",
    "JobFailed",
    "JobsClient",
    "ModelInfo",
    "Score",
    "StreamDelta",
    "TopLogprob",
]
