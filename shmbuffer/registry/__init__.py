"""The episode interval registry: which rows hold which committed episode, and its draws."""
