"""The mixture: exact-match estimates, the continuous cache, the post-hoc gate over them, and the
peers' interpolations."""
