"""The console (issue 9) in real headless Chromium, driven by Playwright.

Debian's ``chromium`` is used (``executable_path``); Playwright's own browser
downloads are never needed. Without Chromium the test fails, saying how to
install it. With ``CONSOLE_SCREENSHOTS=DIR`` set, the pages are also saved
there as PNG (that is how ``docs/console-*.png`` are made).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI
from playwright.sync_api import Browser, BrowserContext, Page, Route, expect, sync_playwright

from catalog_es import commands
from catalog_es.application import Models
from catalog_es.configuration import DeclaredConfig
from catalog_es.inputs import load_config, model_from_data
from catalog_es.spec import MAX_COUNT
from catalog_es.web.app import create_app
from tests.helpers import count_events, log_rows, put_back
from tests.serving import SharedServer, tokens_for_roles

# Two test workers and a browser on two cores: a page of a thousand rows can
# take longer than Playwright's default of 5 s to come.
expect.set_options(timeout=15_000)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_HELP = (
    f"the console test needs Chromium at {CHROMIUM}: install it with "
    "`apt-get update && apt-get install -y chromium` (never `playwright install`)"
)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DECLARED_YAML = """
models:
  - name: llama-3.1-8b-instruct
    engine: vllm
    source: hf://meta-llama/Llama-3.1-8B-Instruct
    profiles: [{name: l4, gpus: 1, gpu_memory_gb: 24}]
    scaling: {min: 2, max: 8}
    class: critical
"""


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """One Chromium for the module's tests: starting it took a second a test."""
    if not Path(CHROMIUM).is_file() or shutil.which(CHROMIUM) is None:
        pytest.fail(CHROMIUM_HELP, pytrace=False)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        yield launched
        launched.close()


@pytest.fixture
def browser(chromium: Browser) -> Iterator[BrowserContext]:
    """A context of the test's own: nothing stored by another test's pages."""
    context = chromium.new_context(viewport={"width": 1360, "height": 900})
    # Only the test server is ever talked to.
    context.route(
        lambda url: not url.startswith("http://127.0.0.1:"),
        lambda route: route.abort(),
    )
    yield context
    context.close()


# Resolved as the run starts: each test runs in a folder of its own, where
# `CONSOLE_SCREENSHOTS=docs` would name a folder that is not there.
SCREENSHOTS = os.environ.get("CONSOLE_SCREENSHOTS")
SCREENSHOTS_FOLDER = Path(SCREENSHOTS).resolve() if SCREENSHOTS else None


def screenshot(page: Page, name: str) -> None:
    if SCREENSHOTS_FOLDER is not None:
        path = SCREENSHOTS_FOLDER / f"console-{name}.png"
        page.screenshot(path=str(path), full_page=True)


@contextmanager
def signed_in(
    browser: BrowserContext, server: SharedServer, models: Models, tmp_path: Path, address: str
) -> Iterator[tuple[Page, str]]:
    """A tab of the console served over ``models`` on ``server``, opened at
    ``address`` and signed in with a read token; no script error may happen
    in it."""
    served = create_app_for(models, tmp_path)
    with console_of(browser, server, served, address) as (page, url, _app):
        yield page, url


def create_app_for(
    models: Models, tmp_path: Path, **options: int
) -> tuple[FastAPI, dict[str, str]]:
    """The app over ``models``, and a token for each role."""
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    return create_app(models, tokens, **options), token


@contextmanager
def console_of(
    browser: BrowserContext,
    server: SharedServer,
    served: tuple[FastAPI, dict[str, str]],
    address: str,
    role: str = "read",
) -> Iterator[tuple[Page, str, FastAPI]]:
    """A tab of the console of ``served`` on ``server``, opened at ``address``
    and signed in with a token of ``role``; no script error may happen in it."""
    app, token = served
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    with server.serving(app) as url:
        page.goto(f"{url}{address}")
        page.fill("#token", token[role])
        page.click("#login button")
        yield page, url, app
        page.close()
    assert errors == []


# What a CDN's Swagger UI could run once taken over: it reads the token.
STEALING_SWAGGER_UI = """
window.SwaggerUIBundle = function () {
  try { window.stolen = sessionStorage.getItem("catalog-es-token") }
  catch (error) { window.stolen = error.name }
};
window.SwaggerUIBundle.presets = {};
"""


def test_the_api_docs_page_cannot_read_the_consoles_token(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """/docs runs Swagger UI from a CDN, at a version that floats, on the
    console's origin: opened in the tab after signing in, its scripts could
    read the token the console keeps (hostile test). Sandboxed, it has an
    origin of its own; the schema it shows is still served to it."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/d.db"})
    with signed_in(browser, shared_server, models, tmp_path, "/console/") as (page, url):
        page.wait_for_selector("#models")
        assert page.evaluate("() => sessionStorage.getItem('catalog-es-token')")
        page.route(
            "https://cdn.jsdelivr.net/**",
            lambda route: route.fulfill(
                content_type="text/javascript" if route.request.url.endswith(".js") else "text/css",
                body=STEALING_SWAGGER_UI if route.request.url.endswith(".js") else "",
            ),
        )
        page.goto(f"{url}/docs")
        page.wait_for_function("() => window.stolen !== undefined")
        assert page.evaluate("() => window.stolen") == "SecurityError"
        title = "async () => (await (await fetch('/openapi.json')).json()).info.title"
        assert page.evaluate(title) == "catalog-es"
    models.close()


def _history(models: Models) -> None:
    """Some runtime history: a model tried, scaled, owned, and another added."""
    qwen = {
        "name": "qwen2.5-7b-instruct",
        "engine": "vllm",
        "source": "hf://Qwen/Qwen2.5-7B-Instruct",
        "profiles": [{"name": "l4", "gpus": 1, "gpu_memory_gb": 24, "min_memory_gb": 32}],
        "scaling": {"min": 0, "max": 2},
        "fallbacks": ["llama-3.1-8b-instruct"],
        "origin": {"repository": "Qwen/Qwen2.5-7B-Instruct", "revision": "a09a35458c70"},
    }
    models.add(model_from_data(qwen, "test"), by="alice", reason="trying Qwen")  # 2
    models.scale("qwen2.5-7b-instruct", 1, 4, by="alice", reason="load test")  # 3
    tiny = {
        "name": "tinyllama-cpu",
        "engine": "llamacpp",
        "source": "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0-GGUF",
        "profiles": [{"name": "cpu", "min_memory_gb": 4, "cpu_cores": 4}],
    }
    models.add(model_from_data(tiny, "test"), by="bob")  # 4
    models.set_owner("qwen2.5-7b-instruct", "team:search", by="carol")  # 5


def test_console_models_history_time_travel_and_rollback(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    config = tmp_path / "catalog.yaml"
    config.write_text(DECLARED_YAML)
    db = f"sqlite:///{tmp_path}/console.db"
    models = Models(load_config(str(config)), env={"CATALOG_ES_DB": db})
    _history(models)
    tokens, token = tokens_for_roles(tmp_path / "tokens.json")
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    with shared_server.serving(create_app(models, tokens)) as url:
        # Signing in: a bad token is refused, a good one is kept for the tab.
        page.goto(f"{url}/")
        page.fill("#token", "ces_nope_nope")
        page.click("#login button")
        expect(page.locator("#login-error")).to_have_text(
            "the token is not valid (unknown or revoked)"
        )
        page.fill("#token", token["admin"])
        page.click("#login button")
        expect(page.locator("#whoami")).to_have_text("admin-user (admin)")

        # The Models page: both layers, the columns the issue asks for.
        table = page.locator("#models tbody")
        expect(table.locator("tr")).to_have_count(3)
        qwen = table.locator('tr[data-model="qwen2.5-7b-instruct"]')
        expect(qwen).to_contain_text("runtime")
        expect(qwen).to_contain_text("team:search")
        expect(qwen).to_contain_text("1..4")
        expect(qwen).to_contain_text("a09a35458c70")
        expect(table.locator('tr[data-model="llama-3.1-8b-instruct"]')).to_contain_text("declared")
        expect(page.locator("#skipped")).to_contain_text("None")
        expect(page.locator("#live")).to_have_class("live on")
        screenshot(page, "models")
        # A badge is one word on one line: at 1300 px "declared" wrapped as "declare / d".
        page.set_viewport_size({"width": 1300, "height": 900})
        lines = table.locator(".badge").evaluate_all(
            "badges => badges.map(b => { const r = document.createRange();"
            " r.selectNodeContents(b); return r.getClientRects().length })"
        )
        assert lines == [1, 1, 1]
        page.set_viewport_size({"width": 1360, "height": 900})

        # A change made elsewhere shows up live.
        models.set_class("tinyllama-cpu", "opportunistic", by="dave")  # 6
        expect(table.locator('tr[data-model="tinyllama-cpu"]')).to_contain_text("opportunistic")

        # A model's page: its definition and history.
        qwen.locator("a").click()
        expect(page.locator("#page h1")).to_contain_text("qwen2.5-7b-instruct")
        expect(page.locator("#definition")).to_contain_text("1..4")
        timeline = page.locator("#history li.entry")
        expect(timeline).to_have_count(3)
        expect(timeline.nth(0)).to_contain_text("alice")
        expect(timeline.nth(0)).to_contain_text("trying Qwen")
        expect(timeline.nth(0)).to_contain_text("defined: vllm hf://Qwen/Qwen2.5-7B-Instruct")
        expect(timeline.nth(1)).to_contain_text("scaling.max: 2 → 4")
        expect(timeline.nth(2)).to_contain_text("carol")
        expect(timeline.nth(2)).to_contain_text('owner: "" → "team:search"')
        screenshot(page, "model")

        # Back to revision 2: the model as it was, and the diff to now.
        page.fill("#revision-number", "2")
        page.dispatch_event("#revision-number", "change")
        expect(page).to_have_url(f"{url}/console/#/model/qwen2.5-7b-instruct?at=2")
        expect(page.locator("#definition")).to_contain_text("0..2")
        diff = page.locator("#diff")
        expect(diff).to_contain_text("Changes from revision 2 to now (6)")
        expect(diff).to_contain_text('{"min":0,"max":2}')
        expect(diff).to_contain_text('{"min":1,"max":4}')

        # The whole catalog at revision 2: tinyllama was not there yet.
        page.click("text=← Models")
        expect(page).to_have_url(f"{url}/console/#/models?at=2")
        expect(table.locator("tr")).to_have_count(2)
        expect(page.locator("#diff tr.added")).to_contain_text("tinyllama-cpu")
        screenshot(page, "revision")

        # A rollback is a dry run first; nothing is written until confirmed.
        written = count_events(db)
        page.click("#rollback-preview")
        plan = page.locator("#rollback")
        expect(plan).to_contain_text("Dry run: roll back the catalog to revision 2")
        expect(plan).to_contain_text("tinyllama-cpu Removed")
        expect(plan).to_contain_text("qwen2.5-7b-instruct Scaled")
        screenshot(page, "rollback")
        assert count_events(db) == written
        page.click("#rollback-confirm")
        expect(page.locator("#flash")).to_contain_text("Rolled back the catalog to revision 2")
        expect(page).to_have_url(f"{url}/console/#/models")
        expect(table.locator("tr")).to_have_count(2)
        assert count_events(db) > written
        last = list(models.log_events(after=written))
        assert {(e["by"], e["rollback_to"]) for e in last} == {("admin-user", 2)}

        # A read token previews a rollback, and is told only an admin confirms
        # it (the button was there, and refused with 403 once clicked).
        # Revision 1, the config's record, was written with revision 2: the
        # server reads it as 0, and the page says so (it said "to revision 1").
        reader = browser.new_page()  # a tab of its own: its own sign-in
        reader.on("pageerror", lambda error: errors.append(str(error)))
        reader.goto(f"{url}/console/#/models?at=1")
        reader.fill("#token", token["read"])
        reader.click("#login button")
        expect(reader.locator("#taken-as")).to_contain_text("taken as revision 0")
        reader.click("#rollback-preview")
        expect(reader.locator("#rollback")).to_contain_text(
            "Dry run: roll back the catalog to revision 0"
        )
        expect(reader.locator("#rollback-admin-only")).to_have_text(
            "Only an admin confirms a rollback; this token is read."
        )
        expect(reader.locator("#rollback-confirm")).to_have_count(0)
        reader.close()

        # A confirmation the log has moved past is refused once, its plan
        # withdrawn (each click added the same refusal under it: hostile test).
        page.goto(f"{url}/console/#/models?at=1")
        page.click("#rollback-preview")
        expect(page.locator("#rollback-confirm")).to_have_count(1)
        models.scale("qwen2.5-7b-instruct", 0, 5, by="elsewhere")
        written = count_events(db)
        page.click("#rollback-confirm")
        expect(page.locator("#rollback-refused")).to_contain_text(
            "someone changed the catalog since you read it"
        )
        expect(page.locator("#rollback .error")).to_have_count(1)
        expect(page.locator("#rollback-confirm")).to_have_count(0)
        assert count_events(db) == written
        page.click("#rollback-again")
        expect(page.locator("#rollback-confirm")).to_have_count(1)

        # The token's role lowered in the tokens file by hand, the page open:
        # the header said admin and the Confirm stayed, refused with 403 at
        # each click, until the next sign-in. The refusal relearns the role.
        held = json.loads(tokens.path.read_text())
        for entry in held["tokens"]:
            if entry["actor"] == "admin-user":
                entry["role"] = "read"
        tokens.path.write_text(json.dumps(held))
        page.click("#rollback-confirm")
        expect(page.locator("#rollback-refused")).to_contain_text("admin")
        expect(page.locator("#whoami")).to_have_text("admin-user (read)")
        page.click("#rollback-again")
        expect(page.locator("#rollback-admin-only")).to_have_text(
            "Only an admin confirms a rollback; this token is read."
        )
        expect(page.locator("#rollback-confirm")).to_have_count(0)
        assert count_events(db) == written

        # An address whose %-escapes are broken is told, not thrown; one with
        # no name drew a nameless model's page, "not in the catalog".
        page.goto(f"{url}/console/#/model/%E0%A4%A")
        expect(page.locator("#error")).to_contain_text("This address names no model: its")
        page.goto(f"{url}/console/#/model/")
        expect(page.locator("#error")).to_have_text("This address names no model.")

        # A revision past the log's last, or no whole number, is told too, with
        # no other page left under it as if it were that one (hostile test).
        for at, told in (
            ("99999", "Revision 99999 is past the log's last, "),
            # Past what a number here holds exactly: told as past the head,
            # not as no whole number.
            ("99999999999999999", "Revision 99999999999999999 is past the log's last, "),
            ("", 'This address\'s revision, "", is not a whole number.'),
            ("2x", 'This address\'s revision, "2x", is not a whole number.'),
        ):
            page.goto(f"{url}/console/#/models")
            expect(page.locator("#models tbody tr")).not_to_have_count(0)
            expect(page.locator("#error")).to_have_text("")
            page.goto(f"{url}/console/#/models?at={at}")
            expect(page.locator("#error")).to_contain_text(told)
            expect(page.locator("#models")).to_have_count(0)
        # Leading zeros are no digits of the number, as the server reads them:
        # these were told past the head.
        page.goto(f"{url}/console/#/models?at=00000000000000002")
        expect(page.locator("#models")).to_have_count(1)
        expect(page.locator("#error")).to_have_text("")

        # Revoked, the token's live stream ends, and the console signs out.
        (admin,) = [e for e in tokens.describe() if e["actor"] == "admin-user"]
        tokens.remove(admin["id"])
        models.set_owner("qwen2.5-7b-instruct", "team:x", by="dave")
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator("#login-error")).to_have_text(
            "the token is not valid (unknown or revoked)"
        )
        page.close()
    assert errors == []
    models.close()


def _catalog_of(models: Models, count: int) -> None:
    """``count`` runtime models beside the declared one, in one write."""
    models.apply_changes(
        [
            commands.add(
                model_from_data(
                    {
                        "name": f"tiny-{i:04d}",
                        "engine": "llamacpp",
                        "source": f"hf://org/tiny-{i:04d}-GGUF",
                        "profiles": [{"name": "cpu", "min_memory_gb": 4}],
                        "owner": "team:search" if i == 42 else "",
                    },
                    "test",
                )
            )
            for i in range(count)
        ],
        by="setup",
    )


def test_console_keeps_up_with_a_busy_log_and_filters_a_large_catalog(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path, pg_url: str
) -> None:
    """On PostgreSQL, where each change reaches the page as it commits (on
    SQLite a watch polls, five times a second)."""
    config = tmp_path / "catalog.yaml"
    config.write_text(DECLARED_YAML)
    models = Models(load_config(str(config)), env={"CATALOG_ES_DB": pg_url})
    _catalog_of(models, 600)
    with signed_in(browser, shared_server, models, tmp_path, "/") as (page, url):
        # A large catalog: the first rows by name are drawn, and it says so.
        rows = page.locator("#models tbody tr")
        expect(rows).to_have_count(500)
        expect(page.locator("#shown")).to_have_text(
            "Showing the first 500 of 601 models by name: narrow the filter to see the rest."
        )
        expect(rows.first).to_have_attribute("data-model", "llama-3.1-8b-instruct")

        # A long diff and a long rollback: the first 500 of each drawn, and
        # how many there are (20,000 took 7.2 s and a page 1.5 million px tall).
        page.goto(f"{url}/console/#/models?at=0")
        expect(page.locator("#diff table.diff tbody tr")).to_have_count(500)
        expect(page.locator("#diff .shown-of")).to_have_text(
            "Showing the first 500 of 600 changes."
        )
        page.locator("#rollback-preview").click()
        expect(page.locator("#rollback ul.events li")).to_have_count(500)
        expect(page.locator("#rollback .shown-of")).to_have_text(
            [
                "Showing the first 500 of 600 compensating events.",
                "Showing the first 500 of 600 changes.",
            ]
        )
        page.locator("#rollback-cancel").click()
        page.goto(f"{url}/console/#/")

        # The filter matches names, owners, sources, engines as it is typed,
        # and the address keeps it.
        page.locator("#filter").press_sequentially("team:sea")
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-model", "tiny-0042")
        expect(page.locator("#shown")).to_have_text("1 model of 601 match.")
        expect(page).to_have_url(f"{url}/console/#/models?q=team%3Asea")
        page.locator("#filter").fill("tiny-05")
        expect(rows).to_have_count(100)
        page.locator("#filter").fill("no such model")
        expect(page.locator("#models tbody")).to_have_text("No model matches “no such model”.")
        page.locator("#filter").fill("GGUF")
        expect(page.locator("#shown")).to_contain_text("of 600 models by name")

        # A busy log: a change every 40 ms until the page was seen to move
        # twice. The page shows the log moving while the changes go on, and
        # keeps the filter and the focus of someone typing in it.
        page.locator("#filter").fill("tiny-0007")
        expect(rows).to_have_count(1)
        start = models.revision
        stop = threading.Event()
        busy = threading.Thread(target=_scale_often, args=(models, "tiny-0007", stop, 0.04))
        busy.start()
        try:
            heading = page.locator("#page h1 small")
            # Moving while the changes go on (they go on until stopped below):
            # the bound is the loaded machine's, 3 s missed once in a full run
            # beside another.
            expect(heading).not_to_have_text(f"now, revision {start}", timeout=10_000)
            seen = int((heading.text_content() or "").rsplit(" ", 1)[1])
            expect(heading).not_to_have_text(f"now, revision {seen}", timeout=10_000)
            expect(rows).to_have_count(1)
            expect(page.locator("#filter")).to_be_focused()
            expect(page.locator("#filter")).to_have_value("tiny-0007")
        finally:
            stop.set()
            busy.join()
        last = models.revision
        expect(heading).to_have_text(f"now, revision {last}")
        expect(rows.first).to_contain_text(f"0..{1 + (last - start - 1) % 3}")

        # A diff of long values (the JSON of a model's profiles, with nowhere
        # to break a line) wraps within the page, as wide as the other tables.
        models.set_resources("tiny-0007", memory_gb=8, cpu_cores=2, by="ops")
        page.goto(f"{url}/console/#/models?at={last}&q=tiny-0007")
        expect(page.locator("#diff")).to_contain_text('"min_memory_gb":8')
        right = "(s) => document.querySelector(s).getBoundingClientRect().right"
        edges = [page.evaluate(f"({right})('{table}')") for table in ("#diff table", "#models")]
        assert edges[0] <= edges[1], f"the diff reaches {edges[0]} px, the page {edges[1]}"

        # A long history: the most recent page of it, and where the rest is
        # (all of it was asked for, and over 10,000 rows refused).
        steps = [commands.scale("tiny-0007", 0, 1 + i % 3) for i in range(1000)]
        models.apply_changes(steps, by="ops")
        page.goto(f"{url}/console/#/model/tiny-0007")
        expect(page.locator("#history li.entry")).to_have_count(1000)
        expect(page.locator("#history")).to_contain_text(
            "The most recent 1,000 changes; all of them: catalog-es history tiny-0007"
        )
        expect(page.locator("#history li.entry").last).to_have_attribute(
            "data-revision", str(models.revision)
        )
        # Exactly a page of it: all shown, and nothing said of older ones (review).
        exact = model_from_data(
            {
                "name": "exact",
                "engine": "llamacpp",
                "source": "hf://org/exact-GGUF",
                "profiles": [{"name": "cpu", "min_memory_gb": 4}],
            },
            "exact",
        )
        models.add(exact, by="ops")
        models.apply_changes([commands.scale("exact", 0, 2 + i % 2) for i in range(999)], by="ops")
        assert len(models.history("exact")) == 1000
        page.goto(f"{url}/console/#/model/exact")
        # Its own history, not the last page's still on screen (of as many rows).
        expect(page.locator("#history li.entry").last).to_have_attribute(
            "data-revision", str(models.revision)
        )
        expect(page.locator("#history li.entry")).to_have_count(1000)
        expect(page.locator("#history")).not_to_contain_text("The most recent")
    models.close()


def test_console_reads_the_past_over_the_config_recorded_then(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A model tried at runtime, then declared by a deploy: at the revision
    it ran as a runtime model, the tick shows it so, and keeps showing the
    past that way while moving about it."""
    db = f"sqlite:///{tmp_path}/console.db"
    before_deploy = tmp_path / "before.yaml"
    before_deploy.write_text(DECLARED_YAML)
    first = Models(load_config(str(before_deploy)), env={"CATALOG_ES_DB": db})
    _history(first)  # 1: the config, 2–5: qwen tried, scaled, owned; tinyllama added
    first.close()
    deployed = tmp_path / "deployed.yaml"
    deployed.write_text(
        DECLARED_YAML
        + """
  - name: qwen2.5-7b-instruct
    engine: vllm
    source: hf://Qwen/Qwen2.5-7B-Instruct
    profiles: [{name: l4, gpus: 1, gpu_memory_gb: 24}]
    scaling: {min: 2, max: 2}
"""
    )
    models = Models(load_config(str(deployed)), env={"CATALOG_ES_DB": db})
    models.set_class("tinyllama-cpu", "opportunistic", by="dave")  # 6: the deploy's config, 7
    with signed_in(browser, shared_server, models, tmp_path, "/console/#/models?at=3") as (
        page,
        url,
    ):
        qwen = page.locator('#models tr[data-model="qwen2.5-7b-instruct"]')
        expect(qwen).to_contain_text("declared")  # over today's config
        expect(qwen).to_contain_text("2..2")
        expect(page.locator("#declared-then")).not_to_be_checked()

        page.check("#declared-then")
        expect(page).to_have_url(f"{url}/console/#/models?at=3&declared=then")
        expect(page.locator("#page h1 small")).to_have_text(
            "at revision 3, over the declared config recorded then"
        )
        expect(qwen).to_contain_text("runtime")
        expect(qwen).to_contain_text("1..4")
        # The diff to now shows what the deploy changed too.
        deploy = page.locator("#diff tr.changed", has_text="qwen2.5-7b-instruct")
        expect(deploy.filter(has_text="declared")).to_contain_text("true")

        # Its page, from the link, reads the same past the same way.
        qwen.locator("a").click()
        expect(page).to_have_url(f"{url}/console/#/model/qwen2.5-7b-instruct?at=3&declared=then")
        expect(page.locator("#page h1")).to_contain_text("runtime")
        expect(page.locator("#definition")).to_contain_text("1..4")
        page.uncheck("#declared-then")
        expect(page.locator("#page h1")).to_contain_text("declared")
        expect(page.locator("#definition")).to_contain_text("2..2")

        # A rollback to it says what it leaves out: its notes, each a line
        # (they were written as "[object HTMLParagraphElement]").
        page.goto(f"{url}/console/#/models?at=3")
        expect(page.locator("#models")).to_be_visible()
        page.locator("#rollback-preview").click()
        expect(page.locator("#rollback p.note")).to_have_text(
            "model 'qwen2.5-7b-instruct' is declared in configuration now; "
            "its runtime history is left out"
        )
        expect(page.locator("#rollback")).not_to_contain_text("[object")
        page.locator("#rollback-cancel").click()

        # Before the first record there is no config "then": no tick, no error.
        page.goto(f"{url}/console/#/models?at=0&declared=then")
        expect(page.locator("#page h1 small")).to_have_text("at revision 0")
        expect(page.locator("#declared-then")).to_have_count(0)
        expect(page.locator("#error")).to_have_text("")

        # Now is what this node runs: no tick to give.
        page.click("#now")
        expect(page.locator("#declared-then")).to_have_count(0)
    models.close()


def test_a_deploys_history_entry_links_to_the_model_as_the_deploy_left_it(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A config record is the first event of its write (a command's events
    follow it), and the link of the model's Declared or Redeclared entry
    went to the record's own revision, read as the state before the write,
    over today's config: the model before the deploy, or as today's config
    has it (review). It goes to where the write ends, over the config
    recorded then."""
    db = f"sqlite:///{tmp_path}/console.db"
    tinyllama = {
        "name": "tinyllama-cpu",
        "engine": "llamacpp",
        "source": "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0-GGUF",
        "profiles": [{"name": "cpu", "min_memory_gb": 4}],
    }
    # Each deploy (8, 5, then 3 replicas at most) recorded by a change of another model.
    for top in (8, 5, 3):
        deployed = tmp_path / f"deployed-{top}.yaml"
        deployed.write_text(DECLARED_YAML.replace("max: 8", f"max: {top}"))
        models = Models(load_config(str(deployed)), env={"CATALOG_ES_DB": db})
        models.add(model_from_data({**tinyllama, "scaling": {"max": top}}, "test"), by="ops")
        if top != 3:
            models.close()
    llama = "llama-3.1-8b-instruct"
    history = models.history(llama)
    assert [(r["event"], r["revision"], r["write_end"]) for r in history] == [
        ("Declared", 1, 2),
        ("Redeclared", 3, 4),
        ("Redeclared", 5, 6),
    ]
    with signed_in(browser, shared_server, models, tmp_path, f"/console/#/model/{llama}") as (
        page,
        url,
    ):
        expect(page.locator("#definition")).to_contain_text("2..3")
        links = page.locator("#history li.entry .when a")
        expect(links).to_have_count(3)
        ends = [link.get_attribute("href") for link in links.all()]
        assert ends == [f"#/model/{llama}?at={at}&declared=then" for at in (2, 4, 6)]
        redeclared = page.locator('#history li[data-revision="3"]')
        expect(redeclared).to_contain_text(
            "revision 3 (written together with revision 4: shown there)"
        )
        redeclared.locator("a").click()
        expect(page).to_have_url(f"{url}/console/#/model/{llama}?at=4&declared=then")
        expect(page.locator("#page h1 small")).to_have_text(
            " at revision 4, over the declared config recorded then"
        )
        expect(page.locator("#taken-as")).to_have_count(0)
        expect(page.locator("#definition")).to_contain_text("2..5")
    models.close()


def _scale_often(models: Models, name: str, stop: threading.Event, pause: float) -> None:
    """Scale ``name`` every ``pause`` seconds until ``stop`` (a minute at most)."""
    deadline = time.monotonic() + 60
    i = 0
    while not stop.is_set() and time.monotonic() < deadline:
        models.scale(name, 0, 1 + i % 3, by="autoscaler")
        i += 1
        stop.wait(pause)


def test_a_model_whose_recent_history_is_past_an_answers_bytes_shows_what_fits(
    browser: BrowserContext,
    shared_server: SharedServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its page was left blank, the API's refusal of a page of its history
    the only line on it (hostile test): the page asks for fewer until an
    answer holds them, and says where the rest are."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    adapters = [{"name": f"a{i}", "source": f"s3://adapters/{'x' * 400}/{i}"} for i in range(40)]
    definition = {
        "name": "big",
        "engine": "vllm",
        "source": "hf://org/big",
        "profiles": [{"name": "gpu", "gpus": 1}],
        "adapters": adapters,
    }
    for maximum in (1, 2, 3):  # rows of 17–51 KB
        models.add(model_from_data({**definition, "scaling": {"max": maximum}}, "big"), by="ops")
    monkeypatch.setattr("catalog_es.web.app.MAX_ANSWER_BYTES", 40_000)
    with signed_in(browser, shared_server, models, tmp_path, "/console/#/model/big") as (
        page,
        _url,
    ):
        expect(page.locator("#definition")).to_contain_text("1..3")
        expect(page.locator("#history li.entry")).to_have_count(1)
        expect(page.locator("#history")).to_contain_text(
            "The most recent 1 change; all of them: catalog-es history big"
        )
    models.close()


def _within_a_write(models: Models) -> None:
    """Revisions 1–4 one apply (a added, scaled to 2, 3, 4), 5 a scaled to 9,
    6 a model, its actor and its reason all long and unbroken."""
    a = {
        "name": "a",
        "engine": "llamacpp",
        "source": "hf://org/a-GGUF",
        "profiles": [{"name": "cpu", "min_memory_gb": 4}],
        "scaling": {"max": 1},
    }
    scales = [commands.scale("a", 1, top) for top in (2, 3, 4)]
    models.apply_changes([commands.add(model_from_data(a, "a")), *scales], by="ops")
    models.scale("a", 1, 9, by="ops")
    long = {**a, "name": "l" + "o" * 127, "source": "hf://org/" + "s" * 300}
    models.add(model_from_data(long, "long"), by="b" * 128, reason="r" * 1000)


def _fits_the_window(page: Page) -> None:
    width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page is {width[0]} px wide in a window of {width[1]}"


def test_console_reads_a_revision_inside_a_write_as_the_server_does(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A revision inside a write of several changes reads as the end of the
    write before it. The console kept the number from the address: "a at
    revision 3" said "Not in the catalog at revision 3", and "Roll back a to
    revision 3" planned, and wrote, a's removal (hostile test). It says the
    revision read, rolls back to that one, and links history entries to where
    their write ends. Beside it: the number box, long text, signing out and
    in (hostile tests too)."""
    db = f"sqlite:///{tmp_path}/console.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    _within_a_write(models)
    served = create_app_for(models, tmp_path)
    with console_of(browser, shared_server, served, "/console/#/model/a", role="admin") as (
        page,
        url,
        _app,
    ):
        # Each entry of the apply links to where the apply ends.
        expect(page.locator("#definition")).to_contain_text("1..9")
        links = page.locator("#history li.entry .when a")
        expect(links).to_have_count(5)
        ends = [link.get_attribute("href") for link in links.all()]
        assert ends == [f"#/model/a?at={at}" for at in (4, 4, 4, 4, 5)]
        third = page.locator('#history li[data-revision="3"]')
        expect(third).to_contain_text("revision 3 (written together with revision 4: shown there)")

        # Asked for revision 3 (as the link was), it says what it read: 0.
        page.goto(f"{url}/console/#/model/a?at=3")
        expect(page.locator("#page h1 small")).to_have_text(" at revision 0")
        expect(page.locator("#taken-as")).to_have_text(
            "No write ends at revision 3 (a write of several changes lands whole): "
            "taken as revision 0, the last one that does before it."
        )
        expect(page.locator("#definition")).to_have_text("Not in the catalog at revision 0.")
        expect(page.locator("#history li.later")).to_have_count(5)
        expect(page.locator("#rollback-preview")).to_have_text("Roll back a to revision 0…")
        page.goto(f"{url}/console/#/models?at=3")
        expect(page.locator("#page h1 small")).to_have_text("at revision 0")
        expect(page.locator("#taken-as")).to_contain_text("taken as revision 0")
        expect(page.locator("#rollback-preview")).to_have_text(
            "Roll back the catalog to revision 0…"
        )

        # From the history, revision 3 shows a as the apply left it, and a
        # rollback there goes to it.
        page.goto(f"{url}/console/#/model/a")
        third.locator("a").click()
        expect(page).to_have_url(f"{url}/console/#/model/a?at=4")
        expect(page.locator("#page h1 small")).to_have_text(" at revision 4")
        expect(page.locator("#taken-as")).to_have_count(0)
        expect(page.locator("#definition")).to_contain_text("1..4")
        expect(page.locator("#history li.later")).to_have_count(1)
        page.click("#rollback-preview")
        expect(page.locator("#rollback h3")).to_have_text("Dry run: roll back a to revision 4")
        expect(page.locator("#rollback")).to_contain_text("a Scaled")
        page.click("#rollback-confirm")
        expect(page.locator("#flash")).to_have_text(
            "Rolled back a to revision 4: now at revision 7."
        )
        expect(page.locator("#definition")).to_contain_text("1..4")
        assert [e["rollback_to"] for e in models.log_events(after=6)] == [4]

        # A 1,000-character reason and 128-character names wrap in the page.
        page.goto(f"{url}/console/#/models")
        expect(page.locator("#models tbody tr")).to_have_count(2)
        _fits_the_window(page)
        page.goto(f"{url}/console/#/model/l{'o' * 127}")
        expect(page.locator("#history")).to_contain_text("r" * 1000)
        _fits_the_window(page)

        # The number box refuses what the address refuses, in its words: an
        # empty one read as 0, one past the head as now.
        for typed, told in (
            ("", 'This address\'s revision, "", is not a whole number.'),
            ("99999", "Revision 99999 is past the log's last, 7."),
        ):
            page.goto(f"{url}/console/#/models")
            expect(page.locator("#models")).to_have_count(1)
            page.fill("#revision-number", typed)
            page.dispatch_event("#revision-number", "change")
            expect(page.locator("#error")).to_have_text(told)
            expect(page.locator("#models")).to_have_count(0)

        # Signing out takes the last error away with the page.
        page.click("#logout")
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator("#error")).to_have_text("")

        # What cannot be a token is said to be none, and not kept.
        for typed in ("ces_ключ_секрет", "x" * 100_000):
            page.fill("#token", typed)
            page.click("#login button")
            expect(page.locator("#login-error")).to_have_text("That token is not valid.")
            assert page.evaluate("() => sessionStorage.getItem('catalog-es-token')") is None
    models.close()


def test_console_says_when_it_cannot_follow_the_log_or_the_log_went_back(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A stream refused (all the server's watches taken) left the page stale,
    its dot still "following the log"; a log put back to an earlier head (a
    backup restored, a failover) froze the page on the lost catalog, its
    stream refused every 2 s as past the head (hostile tests)."""
    db = f"sqlite:///{tmp_path}/console.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    cpu = [{"name": "cpu", "min_memory_gb": 4}]
    tiny = {"name": "m", "engine": "llamacpp", "source": "hf://org/m-GGUF", "profiles": cpu}
    models.add(model_from_data(tiny, "m"), by="ops")  # 1
    models.scale("m", 0, 2, by="ops")  # 2
    saved = log_rows(db)
    models.scale("m", 0, 3, by="ops")
    models.scale("m", 0, 4, by="ops")  # 4
    served = create_app_for(models, tmp_path, max_watches=0)
    with console_of(browser, shared_server, served, "/console/#/models") as (page, _url, app):
        heading = page.locator("#page h1 small")
        expect(heading).to_have_text("now, revision 4")
        dot, note = page.locator("#live"), page.locator("#live-note")
        expect(note).to_have_text("live updates paused")
        expect(dot).to_have_attribute(
            "title",
            "Live updates paused: the server refused the stream (503: 0 watches are open "
            "here, as many as this server serves (serve --max-watches); try again later). "
            "Retrying every 2 s; what is shown may be out of date.",
        )
        expect(dot).not_to_have_class("live on")
        # It keeps asking: once there is room, it follows the log again.
        app.state.stream_places.most = 8
        expect(dot).to_have_class("live on")
        expect(dot).to_have_attribute("title", "following the log")
        expect(note).to_have_text("")

        # The log put back to revision 2 under a server whose streams end (a
        # restart): the page follows it down and says what was lost.
        put_back(db, saved)
        app.state.closing.set()
        expect(dot).not_to_have_class("live on")
        app.state.closing.clear()
        expect(page.locator("#went-back")).to_contain_text(
            "The log went back: its last revision is now 2, where this page had seen 4; "
            "revisions 3–4 were lost (a backup restored, or a failover to a copy that had not "
            "received them; catalog-es verify says whether the log was edited)"
        )
        expect(heading).to_have_text("now, revision 2")
        expect(dot).to_have_class("live on")
        models.scale("m", 0, 5, by="ops")  # 3, again
        expect(heading).to_have_text("now, revision 3")
        expect(page.locator('#models tr[data-model="m"]')).to_contain_text("0..5")
        page.click("#went-back-dismiss")
        expect(page.locator("#went-back")).to_have_count(0)
    models.close()


@contextmanager
def _models_page_at_revision_5(
    browser: BrowserContext, server: SharedServer, tmp_path: Path
) -> Iterator[tuple[Models, Page, str]]:
    """The models page, signed in, at now: revision 5 of :func:`_history`."""
    config = tmp_path / "catalog.yaml"
    config.write_text(DECLARED_YAML)
    models = Models(load_config(str(config)), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    _history(models)
    with signed_in(browser, server, models, tmp_path, "/console/#/models") as (page, url):
        expect(page.locator("#page h1 small")).to_have_text("now, revision 5")
        yield models, page, url
    models.close()


def test_the_revision_picker_keeps_the_keyboards_focus_as_it_steps(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """Each step of the slider, the number box or the tick redraws the page:
    the control stepped on was replaced, the focus fell to the page, and a
    keyboard user's second arrow key did nothing (hostile test). The control
    keeps the focus, so the arrows walk through the past."""
    with _models_page_at_revision_5(browser, shared_server, tmp_path) as (_models, page, url):
        page.focus("#revision")
        for at in (4, 3):
            page.keyboard.press("ArrowLeft")
            expect(page).to_have_url(f"{url}/console/#/models?at={at}")
            expect(page.locator("#page h1 small")).to_have_text(f"at revision {at}")
            expect(page.locator("#revision")).to_be_focused()
        page.keyboard.press("Tab")
        page.keyboard.press("ArrowUp")
        page.keyboard.press("Enter")
        expect(page).to_have_url(f"{url}/console/#/models?at=4")
        # Redrawn, and only then asked: the number box had the focus before
        # the redraw too, and the tick focused on the page about to go.
        expect(page.locator("#page h1 small")).to_have_text("at revision 4")
        expect(page.locator("#revision-number")).to_be_focused()
        page.focus("#declared-then")
        page.keyboard.press("Space")
        expect(page).to_have_url(f"{url}/console/#/models?at=4&declared=then")
        expect(page.locator("#declared-then")).to_be_checked()
        expect(page.locator("#declared-then")).to_be_focused()


def test_a_revision_half_typed_stays_typed_as_a_change_redraws_the_page(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A change arriving while a revision was being typed into the number box
    redrew the page, and the box, replaced, told Chromium's change of what it
    held: the page went to the half-typed revision, 2 of a 25 being typed
    (found fixing a leftover). What was typed stays, with the focus, and
    Enter takes it."""
    with _models_page_at_revision_5(browser, shared_server, tmp_path) as (models, page, url):
        heading = page.locator("#page h1 small")
        page.focus("#revision-number")
        page.keyboard.press("Control+A")
        page.keyboard.type("2")
        models.scale("qwen2.5-7b-instruct", 1, 3, by="ops")  # 6, arriving as the operator types
        expect(heading).to_have_text("now, revision 6")
        expect(page.locator("#revision-number")).to_have_value("2")
        expect(page.locator("#revision-number")).to_be_focused()
        page.keyboard.press("Enter")
        expect(page).to_have_url(f"{url}/console/#/models?at=2")
        expect(heading).to_have_text("at revision 2")


def test_a_change_arriving_as_the_slider_is_dragged_waits_for_the_release(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A change arriving while the slider was dragged redrew the page under
    the pointer: the page went to the revision the drag was passing over, and
    the release, further on, was lost (review). The redraw waits for the
    release, and the release is taken."""
    with _models_page_at_revision_5(browser, shared_server, tmp_path) as (models, page, url):
        heading = page.locator("#page h1 small")
        track = page.locator("#revision").bounding_box()
        assert track is not None
        middle = track["y"] + track["height"] / 2
        page.mouse.move(track["x"] + track["width"] - 2, middle)
        page.mouse.down()
        page.mouse.move(track["x"] + track["width"] * 0.4, middle, steps=5)
        expect(page.locator("#revision-label")).to_have_text("2")
        models.scale("qwen2.5-7b-instruct", 1, 3, by="ops")  # 6, arriving mid-drag
        # The head is read as the page follows the log; the page is not redrawn.
        page.wait_for_timeout(1500)
        expect(heading).to_have_text("now, revision 5")
        page.mouse.move(track["x"] + 1, middle, steps=5)
        page.mouse.up()
        expect(page).to_have_url(f"{url}/console/#/models?at=0")
        expect(heading).to_have_text("at revision 0")


def _a_proxys_page(status: int) -> Callable[[Route], None]:
    """A route handler answering ``status`` with a proxy's HTML page."""
    return lambda route: route.fulfill(
        status=status, content_type="text/html", body="<html>proxy</html>"
    )


def test_an_answer_not_from_the_api_is_told_by_its_status(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A proxy's error page was told by its status's text alone (none at all
    over HTTP/2: a blank page), and its sign-in page, a 200, was read as the
    catalog: "Cannot read properties of null (reading 'filter')" (hostile
    test). Both are told by their status, as not the API's answer."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    with signed_in(browser, shared_server, models, tmp_path, "/console/#/models") as (page, _url):
        expect(page.locator("#models")).to_have_count(1)
        for status, told in ((502, "502 Bad Gateway"), (200, "200 OK")):
            page.route("**/models", _a_proxys_page(status))
            page.evaluate(f"() => location.hash = '#/models?q={status}'")
            expect(page.locator("#error")).to_have_text(
                f"the server answered {told}, not the catalog's API (a proxy in the way?)"
            )
            page.unroute("**/models")
    models.close()


def test_a_server_that_cannot_be_reached_is_told_so(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """The server stopped while the page was open: a page then opened said
    only the browser's "Failed to fetch" (hostile test). It says the server
    did not answer."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    with signed_in(browser, shared_server, models, tmp_path, "/console/#/models") as (page, _url):
        expect(page.locator("#models")).to_have_count(1)
        page.route("**/revision", lambda route: route.abort("connectionrefused"))
        page.evaluate("() => location.hash = '#/models?q=down'")
        expect(page.locator("#error")).to_have_text("No answer from the server (Failed to fetch).")
    models.close()


def test_a_log_whose_last_events_were_deleted_is_told_until_a_write_goes_on(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """The last events deleted by hand (docs/audit.md): `/revision`, whose
    answer is the head, is refused naming both, and the page says so, open
    as they went (its stream refused as past the log's end, every 2 s, the
    page still at the revision deleted) or opened since (where it drew the
    revision before them as now). A write goes on past the gap, and the
    page follows the log again."""
    db = f"sqlite:///{tmp_path}/c.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    cpu = [{"name": "cpu", "min_memory_gb": 4}]
    tiny = {"name": "m", "engine": "llamacpp", "source": "hf://org/m-GGUF", "profiles": cpu}
    for name in ("m", "n"):  # 1, 2
        models.add(model_from_data({**tiny, "name": name}, name), by="ops")
    no_head = (
        "revision 2 is missing: the head is at revision 2 but the log ends at 1, so the last"
        " events were deleted; revision 1 is not the head (catalog-es verify)"
    )
    served = create_app_for(models, tmp_path)
    with console_of(browser, shared_server, served, "/console/#/models") as (page, _url, app):
        heading, error = page.locator("#page h1 small"), page.locator("#error")
        expect(heading).to_have_text("now, revision 2")
        with models.store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM catalog_events WHERE revision = 2")
        app.state.closing.set()  # its stream ends, as at a restart
        expect(page.locator("#live")).not_to_have_class("live on")
        app.state.closing.clear()
        expect(error).to_have_text(no_head)
        page.reload()
        expect(error).to_have_text(no_head)
        expect(page.locator("#models")).to_have_count(0)
        models.scale("m", 0, 3, by="ops")  # 3, after the head
        expect(heading).to_have_text("now, revision 3")
        expect(page.locator('#models tr[data-model="m"]')).to_contain_text("0..3")
        expect(error).to_have_text("")
    models.close()


def test_a_revision_that_was_the_head_follows_the_log_once_it_moves(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """A model's newest history entry links to the head's revision, drawn as
    now: once the log moved on, the page kept saying "now, revision 5" over
    the old definition, its Now button disabled (hostile test). It is
    redrawn as the past it now is, with the diff to now."""
    config = tmp_path / "catalog.yaml"
    config.write_text(DECLARED_YAML)
    models = Models(load_config(str(config)), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/c.db"})
    _history(models)  # revisions 1–5, qwen's owner set last
    address = "/console/#/model/qwen2.5-7b-instruct"
    with signed_in(browser, shared_server, models, tmp_path, address) as (page, url):
        page.locator('#history li[data-revision="5"] a').click()
        expect(page).to_have_url(f"{url}/console/#/model/qwen2.5-7b-instruct?at=5")
        heading = page.locator("#page h1 small")
        expect(heading).to_have_text(" now, revision 5")
        models.scale("qwen2.5-7b-instruct", 0, 9, by="elsewhere")
        expect(heading).to_have_text(" at revision 5")
        expect(page.locator("#definition")).to_contain_text("1..4")
        expect(page.locator("#diff")).to_contain_text('{"min":0,"max":9}')
        expect(page.locator("#now")).to_be_enabled()
    models.close()


# Counts past 2^53, where a double no longer holds every whole number (2^53 + 1
# reads as 2^53), up to the largest a count may be (spec.MAX_COUNT).
PAST_DOUBLES = 2**53 + 1
BIG = {
    "name": "big",
    "engine": "vllm",
    "source": "hf://org/big",
    "profiles": [
        {
            "name": "huge",
            "gpus": PAST_DOUBLES,
            "gpu_memory_gb": PAST_DOUBLES + 2,
            "min_memory_gb": MAX_COUNT,
            "cpu_cores": 2**60 + 1,
        }
    ],
    "scaling": {"min": PAST_DOUBLES, "max": MAX_COUNT},
}


def test_counts_past_2_53_are_shown_and_written_back_exactly(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """The console read the API's JSON with JSON.parse, into doubles: a count
    past 2^53 was shown rounded (scaling 9007199254740993..9223372036854775807
    as 9007199254740992..9223372036854776000) in the list, the definition,
    the history, the diff and a rollback's dry run, whose events, written
    exactly, were not what it showed. Every count is shown as stored, and
    the rollback to the revision typed writes its counts as they were, the
    ones it does not change left as stored."""
    db = f"sqlite:///{tmp_path}/console.db"
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": db})
    models.add(model_from_data(BIG, "big"), by="ops")  # 1
    models.scale("big", 1, PAST_DOUBLES + 4, by="ops")  # 2
    models.set_owner("big", "team:search", by="ops")  # 3
    served = create_app_for(models, tmp_path)
    with console_of(browser, shared_server, served, "/console/#/models", "admin") as (
        page,
        url,
        _app,
    ):
        expect(page.locator('#models tr[data-model="big"]')).to_contain_text("1..9007199254740997")
        page.goto(f"{url}/console/#/model/big")
        definition = page.locator("#definition")
        expect(definition).to_contain_text(
            "huge (9007199254740993 GPU, 9007199254740995 GB GPU, "
            "9223372036854775807 GB, 1152921504606846977 cores)"
        )
        expect(definition).to_contain_text("1..9007199254740997")
        entries = page.locator("#history li.entry")
        expect(entries.nth(0)).to_contain_text(
            "defined: vllm hf://org/big, scaling 9007199254740993..9223372036854775807"
        )
        expect(entries.nth(1)).to_contain_text("scaling.min: 9007199254740993 → 1")
        expect(entries.nth(1)).to_contain_text(
            "scaling.max: 9223372036854775807 → 9007199254740997"
        )

        # Back to revision 1, typed: the diff, the dry run, and what is written.
        page.fill("#revision-number", "1")
        page.dispatch_event("#revision-number", "change")
        expect(definition).to_contain_text("9007199254740993..9223372036854775807")
        diff = page.locator("#diff")
        expect(diff).to_contain_text('{"min":9007199254740993,"max":9223372036854775807}')
        expect(diff).to_contain_text('{"min":1,"max":9007199254740997}')
        page.click("#rollback-preview")
        expect(page.locator("#rollback ul.events")).to_contain_text(
            'big Scaled {"scaling":{"min":9007199254740993,"max":9223372036854775807}}'
        )
        page.click("#rollback-confirm")
        expect(page.locator("#flash")).to_contain_text("Rolled back big to revision 1")
        expect(definition).to_contain_text("9007199254740993..9223372036854775807")
    # What the log holds after: the definition at revision 1, each count exact.
    written = [(e["event"], e["fields"]) for e in models.log_events(after=3)]
    assert written == [("Scaled", {"scaling": BIG["scaling"]}), ("OwnerSet", {"owner": ""})]
    assert models.get_model("big") == models.get_model("big", 1)
    assert models.get_model("big")["profiles"] == BIG["profiles"]
    models.close()


# A browser without JSON.parse's source text (before Chromium 114, Firefox
# 135): its reviver is given no context, and JSON.rawJSON is not there.
WITHOUT_SOURCE_TEXT = """
const parse = JSON.parse;
JSON.parse = (text, reviver) =>
  parse(text, reviver && function (key, value) { return reviver.call(this, key, value); });
delete JSON.rawJSON;
"""


def test_counts_past_2_53_leave_the_page_working_on_a_browser_without_source_text(
    browser: BrowserContext, shared_server: SharedServer, tmp_path: Path
) -> None:
    """The reviver read each number's source text from a context such a
    browser does not give: every answer holding a count past 2^53 threw in
    it, and the list and the model's page said only that no answer came,
    where they showed the counts as JSON.parse reads them. They show the
    model again, its counts as that browser can hold them."""
    models = Models(DeclaredConfig(), env={"CATALOG_ES_DB": f"sqlite:///{tmp_path}/old.db"})
    models.add(model_from_data(BIG, "big"), by="ops")
    browser.add_init_script(WITHOUT_SOURCE_TEXT)
    with signed_in(browser, shared_server, models, tmp_path, "/console/#/models") as (page, url):
        expect(page.locator('#models tr[data-model="big"]')).to_contain_text("vllm")
        page.goto(f"{url}/console/#/model/big")
        expect(page.locator("#definition")).to_contain_text("hf://org/big")
        expect(page.locator("#error")).to_have_text("")
    models.close()
