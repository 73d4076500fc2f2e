"""The learners' exercise files (exN_<topic>.py) and notebooks; a package only so that pytest keeps its conftest apart."""
