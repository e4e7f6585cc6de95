"""The ring and its tables: reservations, eviction, samples, priorities, state and replay."""
