"""The shared gRPC runtime every aimesh service stands on.

It knows nothing about any particular service: services plug in through
`mesh.registry.ServiceSpec` and the `aimesh.services` entry-point group.
"""
