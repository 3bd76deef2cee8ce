"""The HTML report in a real browser (Debian's chromium, driven by selenium).

Usage: report_test.py RESERVOIR_BINARY OUTPUT_DIR TRACE...

Writes a report for the traces under two configs, opens it in headless
chromium and checks that it loads without console errors and without
fetching anything, that every plot is drawn (series with their points,
non-empty boxes), that the segment maps and tables are there, and that the
screenshot shows the plot colours. Then each trace's advice section, and the
page `reservoir advise -o` writes for a recording that ran out of memory: the
two free holes drawn beside the failed request, to scale, and the sweep's
bars. The screenshots are kept in OUTPUT_DIR.
"""
import os
import re
import subprocess
import sys

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

binary, out_dir, traces = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(out_dir, exist_ok=True)
report = os.path.join(out_dir, "report.html")
shot = os.path.join(out_dir, "report_screenshot.png")
configs = ["", "expandable_segments:True"]
cmd = [binary, "report", *traces, "-o", report]
for c in configs:
    cmd += ["-c", c]
# What is checked here is the page: the allocator's per-call validation (set
# in the sanitizer builds) would make the advice's hundreds of replays take
# minutes; the replay, verify and advise tests run under it.
quiet_env = {**os.environ, "RESERVOIR_PROGRESS": "0", "RESERVOIR_VALIDATE": "0"}
subprocess.run(cmd, check=True, env=quiet_env)

opts = webdriver.ChromeOptions()
opts.binary_location = "/usr/bin/chromium"
for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--window-size=1100,1600", "--force-device-scale-factor=1"):
    opts.add_argument(arg)
opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
failures = []
try:
    driver.get("file://" + os.path.abspath(report))
    state = driver.execute_script("return document.readyState")
    if state != "complete":
        failures.append(f"document.readyState is {state}")
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    if errors:
        failures.append(f"console errors: {errors}")
    fetched = driver.execute_script("return performance.getEntriesByType('resource').length")
    if fetched != 0:
        failures.append(f"the report fetched {fetched} resources; it must be self-contained")

    plots = driver.execute_script("""
      return Array.from(document.querySelectorAll('svg.plot')).map(svg => {
        const box = svg.getBoundingClientRect();
        return {id: svg.id, width: box.width, height: box.height,
                series: Array.from(svg.querySelectorAll('polyline.series')).map(p => ({
                  name: p.dataset.series, points: p.points.numberOfItems,
                  width: p.getBBox().width, height: p.getBBox().height}))};
      });""")
    # Per trace: one overlay of both configs, then one plot per config.
    want_plots = len(traces) * (1 + len(configs))
    if len(plots) != want_plots:
        failures.append(f"{len(plots)} plots drawn, expected {want_plots}")
    for p in plots:
        if p["width"] < 800 or p["height"] < 200:
            failures.append(f"plot {p['id']} is {p['width']}x{p['height']}")
        if not p["series"]:
            failures.append(f"plot {p['id']} has no series")
        for s in p["series"]:
            if s["points"] < 1000 or s["width"] < 700 or s["height"] <= 0:
                failures.append(f"plot {p['id']} series {s['name']} drawn as {s}")

    maps = driver.execute_script("""
      return Array.from(document.querySelectorAll('svg.segmap')).map(svg => ({
        blocks: svg.querySelectorAll('rect.block').length,
        allocated: svg.querySelectorAll('rect.active_allocated').length,
        drawn: Array.from(svg.querySelectorAll('rect.block')).filter(
                 r => r.getBBox().width > 0).length}));""")
    if len(maps) != len(traces) * len(configs):
        failures.append(f"{len(maps)} segment maps, expected {len(traces) * len(configs)}")
    for m in maps:
        if m["allocated"] == 0 or m["drawn"] != m["blocks"]:
            failures.append(f"segment map {m}")
    rows = driver.execute_script(
        "return document.querySelectorAll('table.summary tr').length - 1")
    if rows != len(traces) * len(configs):
        failures.append(f"summary table has {rows} rows, expected {len(traces) * len(configs)}")
    # Traces recorded with context name where their largest allocations came from.
    annotated = driver.execute_script(
        "return document.querySelectorAll('table.largest .ann').length")
    with_frames = driver.execute_script(
        "return document.querySelectorAll('table.largest details summary').length")
    if any(t.endswith(".pickle") for t in traces) and (annotated == 0 or with_frames == 0):
        failures.append(f"no annotations ({annotated}) or frames ({with_frames}) in the tables")
    largest = driver.execute_script("return document.querySelectorAll('table.largest').length")
    if largest != len(traces) * len(configs):
        failures.append(f"{largest} tables of largest allocations")

    # The screenshot of the first screen: the overlay plot's two config colours and,
    # below it, the first config's reserved area and requested line.
    driver.execute_script("document.getElementById('plot0').scrollIntoView()")
    driver.save_screenshot(shot)
    img = Image.open(shot).convert("RGB")
    counts = {}
    for name, rgb in {"blue": (0x4e, 0x79, 0xa7), "orange": (0xf2, 0x8e, 0x2b),
                      "red": (0xe1, 0x57, 0x59)}.items():
        counts[name] = sum(1 for px in img.getdata()
                           if all(abs(a - b) <= 12 for a, b in zip(px, rgb)))
    for name, n in counts.items():
        if n < 300:
            failures.append(f"screenshot shows {n} pixels of the {name} series (< 300)")
    print(f"plots {len(plots)}, segment maps {len(maps)}, summary rows {rows}, "
          f"screenshot pixels {counts}, screenshot at {shot}")

    # Each trace's advice: the segments at its moment, and one bar per setting.
    sections = driver.execute_script("""
      return Array.from(document.querySelectorAll('section.advice')).map(sec => ({
        segments: sec.querySelectorAll('svg.advice-segments rect').length,
        bars: Array.from(sec.querySelectorAll('svg.advice-sweep rect.bar')).map(
                r => r.getBBox().width),
        bytes: Array.from(sec.querySelectorAll('svg.advice-sweep rect.bar title')).map(
                t => t.textContent),
        labels: Array.from(sec.querySelectorAll('svg.advice-sweep text.tick')).filter(
                t => t.querySelector('tspan')).map(
                t => Array.from(t.querySelectorAll('tspan')).map(s => s.textContent)),
        best: sec.querySelectorAll('svg.advice-sweep rect.bar.best').length,
        env: Array.from(sec.querySelectorAll('code.env')).map(c => c.textContent)}));""")
    if len(sections) != len(traces):
        failures.append(f"{len(sections)} advice sections, expected {len(traces)}")
    for sec in sections:
        if sec["segments"] == 0 or len(sec["bars"]) < 20 or min(sec["bars"]) <= 0:
            failures.append(f"advice section drawn as {sec}")
        if sec["best"] < 1 or len(sec["env"]) != 2:
            failures.append(f"advice section without its recommendation: {sec}")
        # Bars from zero: each bar's width is to its minimum capacity as every other's.
        sizes = []
        for title in sec["bytes"]:
            m = re.search(r"minimum capacity ([0-9.]+) (GiB|MiB|KiB)", title)
            sizes.append(float(m.group(1)) * {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[m.group(2)])
        ratios = [w / b for w, b in zip(sec["bars"], sizes) if b > 0]
        if not ratios or max(ratios) > min(ratios) * 1.01:
            failures.append(f"sweep bars not drawn from zero: width/bytes from {min(ratios)} to {max(ratios)}")
        # Long settings wrap at their commas and read back whole.
        for lines in sec["labels"]:
            if len(lines) > 1 and not all(x.endswith((",", ":")) for x in lines[:-1]):
                failures.append(f"a setting wrapped elsewhere than at a comma or colon: {lines}")

    # advise -o on the classic case: a 256 MiB segment with two 100 MiB holes
    # and a 160 MiB request that ran out of memory on a 300 MiB device.
    MiB = 1 << 20
    text = os.path.join(out_dir, "classic.trace")
    with open(text, "w") as fh:
        fh.write("reservoir-trace 1\n")
        for line in (f"alloc 0 {256 * MiB}", "free 0", f"alloc 1 {28 * MiB}",
                     f"alloc 2 {100 * MiB}", f"alloc 3 {28 * MiB}", f"alloc 4 {100 * MiB}",
                     "free 2", "free 4", f"alloc 5 {160 * MiB}", "free 5"):
            fh.write(line + "\n")
    classic = os.path.join(out_dir, "classic_oom.pickle")
    subprocess.run([binary, "export", text, "-c", "", "--capacity", "300MiB", "-o", classic],
                   check=True, capture_output=True, env=quiet_env)
    page = os.path.join(out_dir, "advice.html")
    subprocess.run([binary, "advise", classic, "-o", page], check=True, capture_output=True,
                   env=quiet_env)
    driver.get("file://" + os.path.abspath(page))
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    if errors:
        failures.append(f"advice page console errors: {errors}")
    # The answer is on the first screen: the outcome, the line to set.
    first = driver.execute_script("""
      const a = document.querySelector('div.answer');
      if (!a) return null;
      const r = a.getBoundingClientRect();
      return {top: r.top, bottom: r.bottom, height: window.innerHeight, text: a.innerText};""")
    first_shot = os.path.join(out_dir, "advice_first_screen.png")
    driver.save_screenshot(first_shot)
    green = sum(1 for px in Image.open(first_shot).convert("RGB").getdata()
                if all(abs(x - y) <= 3 for x, y in zip(px, (0xee, 0xf4, 0xea))))
    if (first is None or first["bottom"] > first["height"] or green < 5000 or
            not first["text"].startswith("The job ran out of memory: a 160.00 MiB request") or
            "Set PYTORCH_CUDA_ALLOC_CONF=" not in first["text"]):
        failures.append(f"the answer is not on the advice page's first screen: {first}, "
                        f"{green} answer-coloured pixels in {first_shot}")
    drawn = driver.execute_script("""
      const w = sel => Array.from(document.querySelectorAll(sel)).map(r => r.getBBox().width);
      return {request: w('svg.advice-segments rect.request'), holes: w('svg.advice-segments rect.hole'),
              live: w('svg.advice-segments rect.live'), bars: w('svg.advice-sweep rect.bar').length,
              capacity: document.querySelectorAll('svg.advice-sweep line.capacity').length,
              reasons: document.querySelectorAll('ul.reasons li').length};""")
    if len(drawn["request"]) != 1 or len(drawn["holes"]) != 2 or len(drawn["live"]) != 2:
        failures.append(f"classic case drawn as {drawn}")
    elif abs(drawn["request"][0] / drawn["holes"][0] - 1.6) > 0.01:
        failures.append(f"the 160 MiB request is not drawn to the 100 MiB holes' scale: {drawn}")
    if drawn["bars"] < 20 or drawn["capacity"] != 1 or drawn["reasons"] != 4:
        failures.append(f"classic sweep or reasons drawn as {drawn}")
    advice_shot = os.path.join(out_dir, "advice_screenshot.png")
    driver.execute_script("document.querySelector('svg.advice-segments').scrollIntoView()")
    driver.save_screenshot(advice_shot)
    img = Image.open(advice_shot).convert("RGB")
    holes = sum(1 for px in img.getdata() if all(abs(a - b) <= 12 for a, b in zip(px, (0xf2, 0x8e, 0x2b))))
    dashes = sum(1 for px in img.getdata() if all(abs(a - b) <= 20 for a, b in zip(px, (0xcc, 0, 0))))
    if holes < 2000 or dashes < 200:
        failures.append(f"advice screenshot shows {holes} hole pixels, {dashes} request pixels")
    print(f"advice sections {len(sections)}, classic case {drawn}, screenshot at {advice_shot}")
finally:
    driver.quit()

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("report renders in chromium")
