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
	.venv/bin/python manage.py makemigrations --check --dry-run

ci:
	bash .ci/run

screenshots:
	scripts/screenshots.sh
