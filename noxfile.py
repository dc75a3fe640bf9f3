"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s docs`."""

import nox

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, exactly as the README and CI run it."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the package, tests, examples and benchmarks."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings are errors."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")
