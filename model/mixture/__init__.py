"""The mixture: exact-match estimates, the post-hoc gate, the joint gate and its refit, the kNN
store, and the peers' interpolations."""
