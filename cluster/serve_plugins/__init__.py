"""What loopserve plugs into Ray Serve by import path: the engine deployment's request router
(`kv_router.py`, placement on KV headroom) and its autoscaling policy (`autoscaling.py`)."""
