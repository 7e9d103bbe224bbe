"""The course's per-chapter checks (`python3 -m pytest tests/course -k NN`; README.md, "The course"): a package,
so that its conftest and helper modules keep names of their own beside tests/conftest.py when pytest collects
the whole suite."""
