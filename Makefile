.PHONY: install run test lint ci migrations-check bench screenshots

install:
	scripts/bootstrap.sh

run:
	scripts/run.sh

test:
	scripts/test.sh

lint:
	.venv/bin/ruff check .

migrations-check:
	DEBUG=true .venv/bin/python manage.py makemigrations --check --dry-run  # development settings

ci:
	bash .ci/run

screenshots:
	scripts/screenshots.sh
