"""aimesh services: one package per service, each a servicer over its own engine."""
