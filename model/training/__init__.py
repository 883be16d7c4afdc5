"""Training the GPT: the loop, its data, optimizers, low precision and communication across ranks."""
