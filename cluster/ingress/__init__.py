"""How clients reach the connection replicas: the ingress modes and the environment a Ray cluster
starts with (`modes.py`), the HAProxy launcher Serve runs (`haproxy.py`, `loopserve-haproxy`), and
the stale listeners a crashed start leaves behind (`stale.py`)."""
