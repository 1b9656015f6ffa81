"""Package discovery for the wheel: every package under atomc/, plus the two data folders that
pyproject.toml maps into it (templates/ -> atomc.templates, profiles/ -> atomc.profiles)."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["atomc", "atomc.*"]), "atomc.templates", "atomc.profiles"])
