"""The `hf` engines (transformers): inference (generate) and training (one forward), and what only they need."""
