"""Learners' exercise files and notebooks; a package only so that pytest keeps its conftest apart."""
