"""Training draft heads for a target: data from the target itself, cached features, EAGLE-3."""
