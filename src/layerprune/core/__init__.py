"""The ground floor: what everything needs and knows no model (settings, errors, registry, atomic outputs, reports,
provenance, optional extras, recipe loading, the version, paired statistics)."""
