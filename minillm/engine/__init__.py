"""The serving loop: engine -> scheduler (+ block manager) -> model runner."""
