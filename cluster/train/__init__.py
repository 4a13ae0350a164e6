"""Training draft heads for a target: data from the target itself, cached features, and
EAGLE-3, EAGLE-1 and DeepSeek-style MTP trainers."""
