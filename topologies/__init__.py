"""Deployable topologies: `*.yaml` service layouts for `forge-stream up`, and the faust stream apps."""
