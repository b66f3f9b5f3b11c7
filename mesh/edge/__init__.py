"""The Envoy edge: a config derived from the protos and the service table, and the process.

`api` reads what the protos say about each exposed method, `envoy` turns that plus the
mesh settings into Envoy's bootstrap config, `process` runs the real binary.
"""
