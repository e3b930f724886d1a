"""`sat ui` on a real store made by a short real `sat train experiment=cpu_smoke` run.

* Fail fast (no server started): a port outside 1-65535, a busy port, a damaged store: exit 2
  with a `sat: error:` line.
* A real `sat ui` (the CLI in a subprocess, its MLflow server in its own process group): it
  prints the URLs that open the model-training view, runs the server with MLflow's usage
  telemetry disabled, and stops the server on SIGTERM (exit 143).
* A screenshot test in a real headless browser (Debian's ``chromium`` + ``chromium-driver``,
  driven by selenium, no browser download): the printed experiment URL opens the training view
  (runs list, not GenAI's traces and "Evaluation runs"); the run page's "Model metrics" tab shows
  the metric sections ``staleness``, ``sat`` and ``eval/toy`` and the histogram image cards, and
  moving a card's step slider shows the image logged at that step. It skips, saying why, where
  no browser is installed (``.ci/run`` installs it). ``SAT_UI_SCREENSHOT=<file.png>`` also writes
  the screenshot there (``docs/mlflow-run.png`` was made so).

The MLflow server takes ~20 s to answer on 2 idle cores, over a minute under load.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from sat_cli.commands.ui import WORKFLOW_QUERY, base_url, check_port, experiment_url, server_env

mlflow = pytest.importorskip("mlflow")

READY_TIMEOUT_S = 300
# Variables that make MLflow treat the process as CI/testing and disable telemetry on its own:
# removed from `sat ui`'s environment so that only `sat ui` decides.
CI_VARS = (
    "PYTEST_CURRENT_TEST GITHUB_ACTIONS CI CIRCLECI GITLAB_CI JENKINS_URL TRAVIS TF_BUILD "
    "BITBUCKET_BUILD_NUMBER CODEBUILD_BUILD_ARN BUILDKITE TEAMCITY_VERSION CLOUD_RUN_EXECUTION "
    "RUNBOT_HOST_URL RUNBOT_BUILD_NAME RUNBOT_WORKER_ID MLFLOW_DISABLE_TELEMETRY DO_NOT_TRACK"
).split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- fail fast


def test_bad_port_busy_port_and_damaged_store_exit_2(tmp_path, sat_cli):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "mlflow.db").write_text("not a database")
    for port in ("70000", "0", "-1"):
        out = sat_cli("ui", "--port", port, cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert "sat: error: --port" in out.stderr and "1-65535" in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        out = sat_cli("ui", "--port", str(port), cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert f"port {port} on 127.0.0.1 is already in use" in out.stderr
        assert time.monotonic() - start < 110  # the old behaviour: a server that never stopped
        with pytest.raises(Exception, match="already in use"):
            check_port("127.0.0.1", port)
    out = sat_cli("ui", "--port", str(_free_port()), cwd=tmp_path)
    assert out.returncode == 2 and "cannot read the MLflow store" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    out = sat_cli("ui", "--run-dir", "nowhere", cwd=tmp_path)
    assert out.returncode == 2 and "no MLflow store at nowhere/mlflow.db" in out.stderr


def test_server_env_disables_telemetry_unless_asked():
    assert server_env(False, {"A": "1"}) == {"A": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    # a user's own "false" is overridden: off is the default of `sat ui`
    assert server_env(False, {"MLFLOW_DISABLE_TELEMETRY": "false"})["MLFLOW_DISABLE_TELEMETRY"] == (
        "true"
    )
    # --telemetry: the environment as the user has it (MLflow's default, or the user's choice)
    assert server_env(True, {"A": "1"}) == {"A": "1"}
    assert server_env(True, {"DO_NOT_TRACK": "true"}) == {"DO_NOT_TRACK": "true"}


def test_urls_for_wildcard_and_ipv6_hosts():
    assert base_url("127.0.0.1", 5000) == "http://127.0.0.1:5000"
    assert base_url("0.0.0.0", 5001) == "http://127.0.0.1:5001"  # a browser cannot open 0.0.0.0
    assert base_url("::", 5002) == "http://[::1]:5002"
    assert base_url("localhost", 5003) == "http://localhost:5003"
    assert experiment_url("http://h:1", "7") == f"http://h:1/#/experiments/7?{WORKFLOW_QUERY}"
    with pytest.raises(Exception, match="--host must not be empty"):
        check_port(" ", 5000)


# ----------------------------------------------------------------------------- a real sat ui


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sat_cli) -> dict:
    """A store with one short real training run, histograms at every step (1, 2, 3)."""
    root = tmp_path_factory.mktemp("ui")
    args = ["train", "experiment=cpu_smoke", "tracking.histogram_every=1", "run.name=ui"]
    out = sat_cli(*args, cwd=root, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sat")
    (run,) = client.search_runs([exp.experiment_id])
    return {"root": root, "exp": exp, "run_id": run.info.run_id}


class UiProcess:
    def __init__(self, root: Path, port: int):
        env = {k: v for k, v in os.environ.items() if k not in CI_VARS}
        env["PYTHONUNBUFFERED"] = "1"
        self.port = port
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sat_cli.cli", "ui", "--run-dir", "runs", "--port", str(port)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any(line.startswith("Ctrl-C to stop") for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("sat ui did not get ready:\n" + "\n".join(self.lines[-40:]))
            time.sleep(0.5)

    def server_pids(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def close(self) -> None:
        servers = self.server_pids() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in servers:  # only if `sat ui` failed to stop its server
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def ui(trained):
    proc = UiProcess(trained["root"], _free_port())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.close()


@pytest.mark.slow  # ~45 s (a run to show); the refusals of sat ui stay
def test_sat_ui_prints_training_view_urls_and_disables_telemetry(ui, trained):
    base = f"http://127.0.0.1:{ui.port}"
    exp_id = trained["exp"].experiment_id
    assert f"MLflow UI ready: {base}/#/?{WORKFLOW_QUERY}" in ui.lines
    assert f"  experiment 'sat': {base}/#/experiments/{exp_id}?{WORKFLOW_QUERY}" in ui.lines
    assert not any("'Default'" in line for line in ui.lines)  # MLflow's empty default experiment
    # the experiment was created by `sat train` with the model-training kind
    assert trained["exp"].tags["mlflow.experimentKind"] == "custom_model_development"
    # telemetry: the server process runs with it disabled, and tells the browser UI so
    (server,) = ui.server_pids()
    environ = Path(f"/proc/{server}/environ").read_bytes().split(b"\0")
    assert b"MLFLOW_DISABLE_TELEMETRY=true" in environ
    assert not any(v.split(b"=")[0] in (b"CI", b"PYTEST_CURRENT_TEST") for v in environ)
    with urllib.request.urlopen(f"{base}/ajax-api/3.0/mlflow/ui-telemetry", timeout=30) as r:
        assert json.load(r)["disable_ui_telemetry"] is True


# ----------------------------------------------------------------------------- the browser


def _browser() -> tuple[str, str]:
    chrome = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    driver = shutil.which("chromedriver")
    if chrome is None or driver is None:
        pytest.skip(
            "no headless browser: install Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver; .ci/run does)"
        )
    pytest.importorskip("selenium", reason="selenium (the dev extra) drives the browser")
    return chrome, driver


def _chrome(chrome: str, driver: str, profile: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1400",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(driver), options=opts)
    d.set_page_load_timeout(180)
    d.set_script_timeout(180)
    return d


SECTION_HEADER = "[data-testid='experiment-view-compare-runs-section-header']"
CARD = "[data-testid='experiment-view-compare-runs-card']"
# One round trip per read (a loaded 2-core machine makes each WebDriver call slow).
JS_HEADERS = f"""return [...document.querySelectorAll("{SECTION_HEADER}")]
    .map(h => [h.innerText.split("\\n")[0], h]);"""
JS_CARD = f"""const h = [...document.querySelectorAll("{CARD} h4")].find(e => e.title === arguments[0]);
    if (!h) return null;
    const card = h.closest("{CARD}"), thumb = card.querySelector("[role='slider']");
    return {{card: card, thumb: thumb, step: thumb && thumb.getAttribute("aria-valuenow"),
             min: thumb && thumb.getAttribute("aria-valuemin"),
             max: thumb && thumb.getAttribute("aria-valuemax"),
             imgs: [...card.querySelectorAll("img")].map(i => [i.src, i.naturalWidth])}};"""

# scroll the page's scrolling container (MLflow scrolls an inner element, not the window) by
# half a screen
JS_SCROLL_DOWN = """const all = [document.scrollingElement, ...document.querySelectorAll("*")];
    const box = all.find(e => e && e.scrollHeight > e.clientHeight + 50 &&
        ["auto", "scroll"].includes(getComputedStyle(e).overflowY)) || document.scrollingElement;
    box.scrollBy(0, Math.max(200, box.clientHeight / 2));"""


class Page:
    """The few things the checks do with a page: wait, read text, find sections and cards."""

    def __init__(self, driver, failed_png: Path):
        self.d = driver
        self.failed_png = failed_png

    def until(self, pred, what: str, timeout: float = 240):
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.d, timeout, poll_frequency=0.5).until(lambda _: pred())
        except Exception:
            self.d.save_screenshot(str(self.failed_png))
            raise AssertionError(f"{what}; page text: {self.text()[:1500]}") from None

    def text(self) -> str:
        return self.d.execute_script("return document.body.innerText")

    def headers(self) -> dict:
        return dict(self.d.execute_script(JS_HEADERS))

    def scroll(self, element, block: str = "center") -> None:
        self.d.execute_script(f"arguments[0].scrollIntoView({{block: '{block}'}})", element)

    def card(self, key: str) -> dict:
        """A chart card (``card``, slider ``thumb``, ``step``/``min``/``max``, ``imgs`` as
        [src, natural width]); its section is scrolled into view first (cards render lazily),
        then the page scrolls down a little at each poll until the card is rendered (a section
        with many charts, such as ``sat``, has its image cards below the first screen)."""
        self.scroll(self.headers()[key.split("/")[0]], "start")

        from selenium.common.exceptions import StaleElementReferenceException

        def find():
            got = self.d.execute_script(JS_CARD, key)
            if not got:
                self.d.execute_script(JS_SCROLL_DOWN)
                return None
            try:  # the charts re-render while the page scrolls: look again if it went stale
                self.scroll(got["card"])
            except StaleElementReferenceException:
                return None
            return got

        return self.until(find, f"card {key}")

    def state(self, key: str) -> dict:
        return self.d.execute_script(JS_CARD, key)

    def step_right(self, key: str) -> None:
        """One step right on an image card's slider (click the thumb, press the arrow key)."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        for attempt in range(3):  # a chart re-rendered between finding and clicking it
            try:
                thumb = self.card(key)["thumb"]
                ActionChains(self.d).click(thumb).send_keys(Keys.ARROW_RIGHT).perform()
                return
            except StaleElementReferenceException:
                if attempt == 2:
                    raise


def check_experiment_url(page: Page, exp_url: str, exp_id: str, run_name: str) -> None:
    """The URL `sat ui` prints opens the experiment's runs in the model-training view."""
    page.d.get(exp_url)
    page.until(lambda: "/runs" in page.d.current_url, "the experiment URL did not open the runs")
    assert f"#/experiments/{exp_id}/runs" in page.d.current_url
    assert WORKFLOW_QUERY in page.d.current_url
    page.until(lambda: "Run Name" in page.text(), "no run table")
    text = page.text()
    assert f"\n{run_name}\n" in f"\n{text}\n" and "Model registry" in text
    for genai in ("Evaluation runs", "Sessions", "Judges"):  # what the GenAI view shows
        assert genai not in text, genai


def check_run_page(page: Page, run_url: str, run_id: str, shot: Path) -> None:
    """The run's "Model metrics" tab: the metric sections and the histogram image cards; the
    step slider of ``staleness/version_lag`` shows the image of steps 1, 2, 3 in turn."""
    page.d.get(run_url)
    wanted = {"staleness", "sat", "eval/toy"}
    page.until(lambda: wanted <= set(page.headers()), f"metric sections {wanted}")
    page.d.execute_script(  # fold the sections the picture leaves out; close the side panel
        f'for (const h of document.querySelectorAll("{SECTION_HEADER}"))'
        "  if (arguments[0].includes(h.innerText.split('\\n')[0])) h.click();"
        "for (const b of document.querySelectorAll(\"button[aria-label='Close']\"))"
        "  if (b.offsetParent) b.click();",
        ["clip", "loss", "perf", "rollout", "Model metrics"],
    )
    key = "staleness/version_lag"
    card = page.card(key)
    # histograms were logged at steps 1, 2 and 3 (MLflow's slider starts below, at 0)
    assert (card["min"], card["max"]) == ("1", "3")
    seen = []
    for want in (1, 2, 3):
        if page.state(key)["step"] != str(want):
            page.step_right(key)

        def shown(want=want):
            st = page.state(key)
            ok = [
                s
                for s, w in st["imgs"]
                if st["step"] == str(want) and f"%2Bstep%2B{want}%2B" in s and w
            ]
            return ok or None

        src = page.until(shown, f"the {key} image of step {want}")[0]
        assert "staleness~version_lag" in src and f"run_uuid={run_id}" in src
        seen.append(src)
    assert len(set(seen)) == 3
    for other in ("staleness/abs_logratio", "sat/contraction"):  # their last step, for the picture
        for _ in range(3):
            if page.card(other)["step"] != "3":
                page.step_right(other)
        page.until(lambda other=other: [w for _, w in page.state(other)["imgs"] if w], other)
    # tall enough for the sections eval/toy, sat (15 charts) and staleness with their images
    page.d.set_window_size(1400, 5200)
    for key in ("staleness/abs_logratio", "staleness/version_lag", "sat/contraction"):
        page.card(key)  # scrolled to, so it renders
        page.until(lambda key=key: [w for _, w in page.state(key)["imgs"] if w], key)
    page.d.execute_script(  # inside each image card: the image, below the run's label
        f"document.querySelectorAll(\"{CARD} img\").forEach(i => i.scrollIntoView({{block: 'nearest'}}))"
    )
    page.scroll(page.headers()["eval/toy"], "start")
    time.sleep(2)
    assert page.d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


@pytest.mark.slow  # ~80 s; test_sat_ui_prints_training_view_urls_and_disables_telemetry stays
def test_run_page_in_headless_chromium(ui, trained, tmp_path):
    chrome, driver = _browser()
    base = f"http://127.0.0.1:{ui.port}"
    exp_id, run_id = trained["exp"].experiment_id, trained["run_id"]
    exp_url = next(line.split(": ", 1)[1] for line in ui.lines if "experiment 'sat'" in line)
    run_url = f"{base}/#/experiments/{exp_id}/runs/{run_id}/model-metrics?{WORKFLOW_QUERY}"
    shot = tmp_path / "mlflow-run.png"
    with tempfile.TemporaryDirectory() as profile:
        d = _chrome(chrome, driver, profile)
        try:
            page = Page(d, tmp_path / "failed.png")
            check_experiment_url(page, exp_url, exp_id, "ui")
            check_run_page(page, run_url, run_id, shot)
        finally:
            d.quit()
    if os.environ.get("SAT_UI_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["SAT_UI_SCREENSHOT"])


def _group(pgid: int) -> list[int]:
    """Live processes in a process group (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow  # ~60 s; the urls test stays in the default suite
def test_sat_ui_stops_its_server_on_sigterm(ui):
    (server,) = ui.server_pids()
    assert _group(server)  # the mlflow server and its uvicorn process, in their own group
    ui.proc.send_signal(signal.SIGTERM)
    assert ui.proc.wait(60) == 143
    ui._reader.join(10)
    assert "sat: interrupted (SIGTERM)" in ui.lines
    deadline = time.monotonic() + 30
    while _group(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group(server) == []
    check_port("127.0.0.1", ui.port)  # the port is free again
