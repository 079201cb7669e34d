"""Offline tools: simulate, demo, and the terminal tables."""
