// Opens a course notebook in JupyterLab, runs it cell by cell in headless Chromium, and checks that its
// widgets really work in a browser: every widget view rendered; pressing play on the first BlockMap changes
// the heatmap and moves the slider, hovering a block shows its details; where the notebook has a live
// throughput plot (.labkit-throughput), it gains points while the cell driving the engine runs. Saves
// screenshots to OUT_DIR. Exits non-zero on any failure.
//
// usage: node notebook.mjs NOTEBOOK_URL NOTEBOOK_FILE OUT_DIR   (CHROMIUM overrides /usr/bin/chromium)
import { mkdtempSync, mkdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, notebookFile, outDir] = process.argv.slice(2);
if (!url || !notebookFile || !outDir) {
  console.error("usage: node notebook.mjs NOTEBOOK_URL NOTEBOOK_FILE OUT_DIR");
  process.exit(2);
}
const numCells = JSON.parse(readFileSync(notebookFile, "utf8")).cells.length;
mkdirSync(outDir, { recursive: true });
const deadline = setTimeout(() => fail("gave up after 170 s"), 170_000);

const profile = mkdtempSync(join(tmpdir(), "labkit-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1500, height: 1000 },
  args: [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
  ],
});
const page = context.pages()[0] ?? (await context.newPage());
const pageErrors = [];
page.on("pageerror", (error) => pageErrors.push(String(error)));

async function fail(message) {
  console.error(`FAIL: ${message}`);
  if (pageErrors.length) console.error(`page errors:\n  ${pageErrors.join("\n  ")}`);
  try {
    await page.screenshot({ path: join(outDir, "failure.png") });
    console.error(`screenshot: ${join(outDir, "failure.png")}`);
  } catch {}
  process.exit(1);
}

async function check(condition, message) {
  if (!condition) await fail(message);
  console.log(`ok: ${message}`);
}

// Polls probe() until accept(value) holds, for up to 30 s; returns the value.
async function waitFor(probe, accept, what) {
  for (let waited = 0; waited < 30_000; waited += 250) {
    const value = await probe();
    if (accept(value)) return value;
    await page.waitForTimeout(250);
  }
  return fail(`timed out waiting for ${what}`);
}

// Points in the throughput plot: the sum of every trace's x length, as plotly.js holds them.
const throughputPoints = () =>
  page.evaluate(() => {
    const gd = document.querySelector(".labkit-throughput .js-plotly-plot");
    return gd && gd.data ? gd.data.reduce((n, trace) => n + (trace.x ? trace.x.length : 0), 0) : -1;
  });

// What the BlockMap shows: the heatmap's values, the rendered heatmap image, the step on the slider.
const blockMapShown = () =>
  page.evaluate(() => {
    const gd = document.querySelector(".labkit-blockmap-figure .js-plotly-plot");
    if (!gd || !gd.data) return null;
    const image = gd.querySelector(".heatmaplayer image");
    const readout = document.querySelector(".labkit-step-slider .widget-readout");
    return {
      z: JSON.stringify(gd.data[0].z),
      image: image ? image.getAttribute("href") : null,
      step: readout ? readout.textContent.trim() : null,
      title: gd.layout.title.text,
    };
  });

try {
  await page.goto(url, { waitUntil: "domcontentloaded" });
  const cells = page.locator(".jp-Notebook .jp-Cell");
  await cells.nth(numCells - 1).waitFor({ timeout: 60_000 });
  await page.locator("#jp-main-statusbar", { hasText: "| Idle" }).waitFor({ timeout: 60_000 });
  console.log(`ok: JupyterLab shows the notebook's ${numCells} cells and its kernel is idle`);
  const count = await cells.count();
  await cells.first().locator(".jp-InputPrompt").click();
  await page.keyboard.press("Escape");
  let pointsBefore = null;
  const samples = [];
  for (let i = 0; i < count; i++) {
    const cell = cells.nth(i);
    const isCode = await cell.evaluate((el) => el.classList.contains("jp-CodeCell"));
    const source = await cell.locator(".jp-InputArea-editor").innerText();
    const isRunCell = isCode && source.includes("engine.step()") && (await throughputPoints()) >= 0;
    if (isRunCell) pointsBefore = await waitFor(throughputPoints, (n) => n >= 0, "the throughput plot to render");
    await page.keyboard.press("Shift+Enter");
    if (!isCode) continue;
    const prompt = cell.locator(".jp-InputPrompt");
    const started = Date.now();
    while (!/\[\d+\]/.test(await prompt.innerText())) {
      if (Date.now() - started > 120_000) await fail(`cell ${i} did not finish in 120 s`);
      if (isRunCell) samples.push(await throughputPoints());
      await page.waitForTimeout(200);
    }
    const errors = await cell
      .locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
      .allInnerTexts();
    const failures = errors.filter((text) => /Traceback|Error/.test(text));
    await check(failures.length === 0, `cell ${i} ran without errors${failures.length ? `:\n${failures.join("\n")}` : ""}`);
  }

  // Every widget view rendered: no output area is left showing a widget model that failed to load.
  await page.waitForTimeout(1000); // the last comm messages
  // Plotly draws lazily: bring each widget into view first. A widget is a plotly plot itself (a
  // FigureWidget) or holds one (a box of controls and a plot); it is drawn once the plot has its data.
  const widgets = page.locator(".labkit-blockmap, .labkit-timeline, .labkit-throughput");
  for (let i = 0; i < (await widgets.count()); i++) await widgets.nth(i).scrollIntoViewIfNeeded();
  await page.waitForTimeout(500);
  const [views, drawn, missing] = await page.evaluate(() => {
    const all = [...document.querySelectorAll(".labkit-blockmap, .labkit-timeline, .labkit-throughput")];
    const plot = (el) => (el.matches(".js-plotly-plot") ? el : el.querySelector(".js-plotly-plot"));
    const undrawn = all.filter((el) => !plot(el)?.data).map((el) => el.className);
    return [all.length, all.length - undrawn.length, undrawn.join(", ")];
  });
  await check(views > 0 && drawn === views, `all ${views} labkit widgets rendered a plotly figure (${drawn}; not drawn: ${missing || "none"})`);

  // Where there is a live throughput plot, it gained points while the run cell executed.
  if (pointsBefore !== null) {
    const pointsAfter = await throughputPoints();
    const during = samples.filter((n) => n > pointsBefore && n < pointsAfter);
    console.log(`throughput points: ${pointsBefore} before the run, ${during.length} samples in between, ${pointsAfter} after`);
    await check(pointsBefore === 0, "the throughput plot was empty before the run");
    await check(pointsAfter > 0, "the throughput plot gained points");
    const throughput = page.locator(".labkit-throughput").first();
    await throughput.scrollIntoViewIfNeeded();
    await throughput.screenshot({ path: join(outDir, "throughput.png") });
  }

  // Pressing play on the BlockMap moves it through the recorded steps.
  const blockMap = page.locator(".labkit-blockmap").first();
  await blockMap.scrollIntoViewIfNeeded();
  const before = await waitFor(blockMapShown, (shown) => shown && shown.image, "the BlockMap heatmap to render");
  await check(true, `the BlockMap heatmap rendered (${before.title})`);
  await page.locator(".labkit-play button").first().click();
  let after = before;
  for (let waited = 0; waited < 15_000 && after.z === before.z; waited += 250) {
    await page.waitForTimeout(250);
    after = await blockMapShown();
  }
  await page.waitForTimeout(2500); // let it play a little further for the screenshot
  after = await blockMapShown();
  console.log(`BlockMap: step ${before.step} -> ${after.step}; "${after.title}"`);
  await check(after.z !== before.z, "pressing play changed the heatmap's values");
  await check(after.image !== before.image, "pressing play changed the rendered heatmap");
  await check(Number(after.step) > Number(before.step), "the step slider moved forward");
  // Pause, then hover the first block: plotly.js shows the cell's details.
  await page.locator(".labkit-play button").first().click();
  await page.waitForTimeout(800);
  await blockMap.scrollIntoViewIfNeeded();
  const box = await page.locator(".labkit-blockmap-figure .heatmaplayer image").first().boundingBox();
  const [rows, columns] = await page.evaluate(() => {
    const z = document.querySelector(".labkit-blockmap-figure .js-plotly-plot").data[0].z;
    return [z.length, z[0].length];
  });
  await page.mouse.move(box.x + box.width / columns / 2, box.y + box.height / rows / 2);
  const hover = page.locator(".labkit-blockmap-figure .hoverlayer .hovertext");
  await hover.first().waitFor({ timeout: 5000 });
  const hoverText = (await hover.first().textContent()) || "";
  console.log(`hover on block 0: "${hoverText}"`);
  await check(/^block 0(free|request \d+\d+\/\d+ slots filledrefs 1)$/.test(hoverText), "hovering a cell shows its details");
  await blockMap.screenshot({ path: join(outDir, "blockmap.png") });
  await page.screenshot({ path: join(outDir, "page.png") });
  const timeline = page.locator(".labkit-timeline").first();
  if ((await timeline.count()) > 0) {
    await timeline.scrollIntoViewIfNeeded();
    await timeline.screenshot({ path: join(outDir, "timeline.png") });
  }
  console.log(`screenshots in ${outDir}`);
  if (pageErrors.length) console.log(`page errors (not fatal):\n  ${pageErrors.join("\n  ")}`);
} catch (error) {
  await fail(error.stack || String(error));
}
clearTimeout(deadline);
await context.close();
rmSync(profile, { recursive: true, force: true });
console.log("browser test passed");
