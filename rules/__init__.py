"""The built-in rule library (*.rule) and its shipped proof verdicts, installed as package data."""
