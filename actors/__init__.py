"""Ray Serve deployments: thin adapters over `cluster.core`."""
