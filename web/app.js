// berth's operator page: what berth knows, and a build followed live.
// Plain ES module, no build step. The service token lives in sessionStorage
// only (never in a URL or a cookie); event streams use short-lived stream
// tickets, so no token appears in any URL.

const TOKEN_KEY = 'berth.token';
/** Lines appended to the log view per animation frame at most. */
const MAX_LINES_PER_FRAME = 5000;
/** Deployments shown on the list (the API's page limit). */
const LIST_LIMIT = 100;

const main = document.getElementById('main');
const nav = document.getElementById('nav');

/** Work to undo when the view changes (open event streams). */
let cleanup = [];

class Unauthorized extends Error {}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

/** An idempotency key; works outside secure contexts too (plain http on a LAN). */
function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return 'page-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}

async function api(method, path, { body, headers = {} } = {}) {
  const h = { Authorization: `Bearer ${token()}`, ...headers };
  if (body !== undefined) h['Content-Type'] = 'application/json';
  const r = await fetch(path, {
    method,
    headers: h,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) throw new Unauthorized();
  const text = await r.text();
  let data = text;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // Not JSON (a log): keep the text.
  }
  return { status: r.status, ok: r.ok, data, etag: r.headers.get('ETag') };
}

/** Creates an element: el('a', {href: '#/'}, 'text', child, ...). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else if (k === 'class') node.className = v;
    else node.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function show(...nodes) {
  main.replaceChildren(...nodes);
}

function when(t) {
  return t ? new Date(t).toLocaleString() : '';
}

function badge(state) {
  return el('span', { class: `state ${state}` }, state);
}

function problem(res) {
  const d = res.data || {};
  return el(
    'div',
    { class: 'errors', role: 'alert' },
    el('strong', {}, `${res.status} ${d.code || ''}`),
    ' ',
    d.message || '',
    d.deployer_message ? el('pre', { class: 'json' }, d.deployer_message) : null,
    fieldList(d.fields),
  );
}

/** A 422's field errors, each next to its JSON pointer. */
function fieldList(fields) {
  if (!fields || fields.length === 0) return null;
  return el(
    'ul',
    { class: 'fields' },
    fields.map((f) =>
      el('li', { 'data-pointer': f.pointer }, el('code', {}, f.pointer || '(the whole document)'), ': ', f.message || f.code),
    ),
  );
}

// ---- routing ----------------------------------------------------------

window.addEventListener('hashchange', route);
route();

async function route() {
  cleanup.forEach((f) => f());
  cleanup = [];
  if (!token()) return signIn();
  nav.replaceChildren(
    el('a', { href: '#/' }, 'Deployments'),
    el('a', { href: '#/new' }, 'Submit'),
    el('a', { href: '#/webhooks' }, 'Webhooks'),
    el('button', { type: 'button', onclick: signOut }, 'Sign out'),
  );
  const hash = location.hash.slice(1) || '/';
  const [path, query] = hash.split('?');
  // The last view goes at once: one build's log is never on screen under
  // another build's address while the new view loads.
  show(el('p', { class: 'muted', 'aria-busy': 'true' }, 'Loading…'));
  try {
    if (path === '/') await listView();
    else if (path.startsWith('/d/')) await deploymentView(decodeURIComponent(path.slice(3)));
    else if (path.startsWith('/b/')) await buildView(path.slice(3));
    else if (path === '/new') await submitView(new URLSearchParams(query).get('id') || '');
    else if (path === '/webhooks') await webhooksView();
    else show(el('h1', {}, 'Not found'), el('a', { href: '#/' }, 'Back to the deployments'));
  } catch (e) {
    if (e instanceof Unauthorized) return refused();
    // fetch rejects only when berth could not be reached at all.
    const why = e instanceof TypeError ? 'berth could not be reached (a network error).' : String(e);
    show(
      el('h1', {}, 'Something went wrong'),
      el('p', { class: 'errors', role: 'alert' }, why),
      el('div', { class: 'row' }, el('button', { type: 'button', onclick: route }, 'Try again')),
    );
  }
  main.focus();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  location.hash = '#/';
  route();
}

function signIn(message) {
  nav.replaceChildren();
  const input = el('input', { id: 'token', type: 'password', autocomplete: 'current-password', required: true });
  const form = el(
    'form',
    {
      onsubmit: async (e) => {
        e.preventDefault();
        sessionStorage.setItem(TOKEN_KEY, input.value.trim());
        route();
      },
    },
    el('h1', {}, 'Sign in'),
    message ? el('p', { class: 'errors', role: 'alert' }, message) : null,
    el('label', { for: 'token' }, 'Service token'),
    input,
    el('p', { class: 'muted' }, 'In berth-data/service-token on the machine. Kept in this tab only.'),
    el('div', { class: 'row' }, el('button', { class: 'primary', type: 'submit' }, 'Sign in')),
  );
  show(form);
  input.focus();
}

/** The 401 screen: the token was refused (wrong, or changed since). */
function refused() {
  sessionStorage.removeItem(TOKEN_KEY);
  cleanup.forEach((f) => f());
  cleanup = [];
  signIn('berth refused this token (401). Sign in again with the current service token.');
  document.body.dataset.screen = 'unauthorized';
}

// ---- event streams ----------------------------------------------------

/**
 * Follows one channel with EventSource and a stream ticket. The browser
 * reconnects by itself with Last-Event-ID; when the ticket is gone (berth
 * restarted), a new ticket resumes at the last id seen.
 */
function follow(channel, handlers, { cursor = null } = {}) {
  let source = null;
  // Where to start: after `cursor` (a log read's Berth-Event-Cursor), or
  // from the channel's first event.
  let lastId = cursor;
  let closed = false;
  const open = async () => {
    if (closed) return;
    let res;
    try {
      res = await api('POST', '/v1/stream-tickets', { body: { channel } });
    } catch (e) {
      if (e instanceof Unauthorized) return refused();
      setTimeout(open, 1000);
      return;
    }
    if (!res.ok) {
      setTimeout(open, 1000);
      return;
    }
    const params = new URLSearchParams({ ticket: res.data.ticket });
    if (lastId !== null) params.set('cursor', lastId);
    source = new EventSource(`${channel}?${params}`);
    for (const [name, fn] of Object.entries(handlers)) {
      source.addEventListener(name, (ev) => {
        if (ev.lastEventId) lastId = ev.lastEventId;
        fn(ev, stop);
      });
    }
    source.onerror = () => {
      // CLOSED: the browser gave up (the ticket is no longer valid).
      if (source.readyState === EventSource.CLOSED && !closed) setTimeout(open, 500);
    };
  };
  const stop = () => {
    closed = true;
    if (source) source.close();
  };
  cleanup.push(stop);
  open();
  return { stop };
}

// ---- views --------------------------------------------------------------

async function listView() {
  const res = await api('GET', `/v1/deployments?limit=${LIST_LIMIT}`);
  if (!res.ok) return show(problem(res));
  const items = [...res.data.items].sort((a, b) => (a.updated_at < b.updated_at ? 1 : -1));
  // Instances come with each deployment's read.
  const reads = await Promise.all(items.map((d) => api('GET', `/v1/deployments/${encodeURIComponent(d.id)}`)));
  const rows = items.map((d, i) => {
    const instances = (reads[i].ok && reads[i].data.instances) || [];
    return el(
      'tr',
      { 'data-deployment': d.id },
      el('td', {}, el('a', { href: `#/d/${encodeURIComponent(d.id)}` }, d.id)),
      el('td', {}, badge(d.state), d.suspended ? el('span', { class: 'muted' }, ' suspended') : null),
      el('td', { class: 'hide-narrow' }, d.domain || ''),
      el(
        'td',
        { class: 'hide-narrow' },
        instances
          .filter((x) => x.enabled)
          .map((x) => (x.url ? el('a', { href: x.url, rel: 'noreferrer' }, x.name) : x.name))
          .flatMap((n, j) => (j ? [', ', n] : [n])),
      ),
      el(
        'td',
        {},
        d.last_build
          ? el('a', { href: `#/b/${d.last_build.id}` }, badge(d.last_build.status))
          : el('span', { class: 'muted' }, 'none'),
      ),
      el('td', { class: 'hide-narrow muted' }, when(d.updated_at)),
    );
  });
  show(
    el('h1', {}, 'Deployments'),
    items.length === 0
      ? el('p', {}, 'No deployments yet. ', el('a', { href: '#/new' }, 'Submit a configuration'), '.')
      : el(
          'div',
          { class: 'scroll' },
          el(
            'table',
            {},
            el(
              'thead',
              {},
              el(
                'tr',
                {},
                el('th', {}, 'Deployment'),
                el('th', {}, 'State'),
                el('th', { class: 'hide-narrow' }, 'Domain'),
                el('th', { class: 'hide-narrow' }, 'Instances'),
                el('th', {}, 'Last build'),
                el('th', { class: 'hide-narrow' }, 'Updated'),
              ),
            ),
            el('tbody', {}, rows),
          ),
        ),
  );
}

async function deploymentView(id) {
  const path = `/v1/deployments/${encodeURIComponent(id)}`;
  let pending = null;
  // A render whose reads finish after the view was left must not draw
  // over the next view.
  let gone = false;
  cleanup.push(() => {
    gone = true;
    clearTimeout(pending);
  });
  const render = async () => {
    const [res, builds] = await Promise.all([api('GET', path), api('GET', `${path}/builds?limit=20`)]);
    if (gone) return;
    if (res.status === 404) return show(el('h1', {}, id), el('p', {}, 'No such deployment (deleted?).'));
    if (!res.ok) return show(problem(res));
    const d = res.data;
    const message = el('div', { 'aria-live': 'polite' });
    const act = async (name) => {
      const r = await api('POST', `${path}/actions/${name}`, {
        headers: { 'If-Match': res.etag, 'Idempotency-Key': newKey() },
      });
      if (!r.ok) message.replaceChildren(problem(r));
      else render();
    };
    // A rollback to one earlier build: its snapshot deployed again.
    const rollbackTo = async (buildId) => {
      const r = await api('POST', `${path}/actions/rollback`, {
        body: { build_id: buildId },
        headers: { 'If-Match': res.etag, 'Idempotency-Key': newKey() },
      });
      if (!r.ok) message.replaceChildren(problem(r));
      else location.hash = `#/b/${r.data.build_id}`;
    };
    const rollback = d.actions.find((a) => a.name === 'rollback');
    const deployedId = d.deployed ? d.deployed.build_id : null;
    const remove = async () => {
      if (!confirm(`Delete ${id}? Its resources are destroyed.`)) return;
      const r = await api('DELETE', path, { headers: { 'Idempotency-Key': newKey() } });
      if (!r.ok) message.replaceChildren(problem(r));
      else render();
    };
    // The rollout's waves come with its build.
    const rolloutBuild = d.rollout ? await api('GET', `/v1/builds/${d.rollout.build_id}`) : null;
    if (gone) return;
    show(
      el('h1', {}, id, ' ', badge(d.state)),
      d.frozen
        ? el('p', { class: 'banner', role: 'status', 'data-frozen': d.frozen.scope }, `Frozen (${d.frozen.scope}): ${d.frozen.reason}`, d.frozen.until ? ` — until ${when(d.frozen.until)}` : '')
        : '',
      message,
      el(
        'div',
        { class: 'row' },
        // `deploy` is a submit and `delete` the DELETE route; the rest are
        // actions. Each says why when it is not possible now.
        el('a', { href: `#/new?id=${encodeURIComponent(id)}` }, 'Change configuration'),
        d.actions
          .filter((a) => a.name !== 'deploy' && a.name !== 'delete')
          .map((a) =>
            el('button', { type: 'button', disabled: !a.enabled, title: a.reason || `run ${a.name}`, 'data-action': a.name, onclick: () => act(a.name) }, a.name),
          ),
        ((del) =>
          el('button', { type: 'button', class: 'danger', disabled: del && !del.enabled, title: (del && del.reason) || 'destroy and delete', onclick: remove }, 'Delete'))(
          d.actions.find((a) => a.name === 'delete'),
        ),
      ),
      el(
        'dl',
        {},
        el('dt', {}, 'Domain'),
        el('dd', {}, d.domain || '—'),
        el('dt', {}, 'Instances'),
        el('dd', {}, d.instances.filter((x) => x.enabled).map((x) => el('div', {}, x.url ? el('a', { href: x.url, rel: 'noreferrer' }, x.url) : x.name))),
        el('dt', {}, 'Source'),
        el('dd', {}, `${d.source.url} @ ${d.source.rev}`),
        el('dt', {}, 'Update policy'),
        el('dd', {}, d.update_policy.kind, d.update?.last_automatic ? ` (last automatic: ${d.update.last_automatic.result})` : ''),
        el('dt', {}, 'Automatic rollback'),
        el('dd', { 'data-auto-rollback': String(d.auto_rollback) }, d.auto_rollback ? 'on: a deploy that breaks a node is rolled back' : 'off'),
        el('dt', {}, 'Revision'),
        el('dd', {}, String(d.revision)),
      ),
      d.rollout ? rolloutSection(d.rollout, rolloutBuild && rolloutBuild.ok ? rolloutBuild.data.rollout : null) : '',
      d.nodes && d.nodes.length ? nodesSection(d.nodes) : '',
      el('h2', {}, 'Builds'),
      el(
        'div',
        { class: 'scroll' },
        el(
          'table',
          {},
          el('thead', {}, el('tr', {}, el('th', {}, 'Build'), el('th', {}, 'Status'), el('th', { class: 'hide-narrow' }, 'Kind'), el('th', { class: 'hide-narrow' }, 'Created'), el('th', {}, ''))),
          el(
            'tbody',
            {},
            (builds.ok ? builds.data.items : []).map((b) =>
              el(
                'tr',
                { 'data-build': b.id },
                el('td', {}, el('a', { href: `#/b/${b.id}` }, b.id.slice(0, 13) + '…')),
                el('td', {}, badge(b.status), b.rollback_of ? el('span', { class: 'muted', 'data-rollback-of': b.rollback_of }, ` rollback to ${b.rollback_of.slice(0, 13)}…`) : ''),
                el('td', { class: 'hide-narrow' }, b.kind, b.trigger === 'automatic_rollback' ? ' (automatic)' : ''),
                el('td', { class: 'hide-narrow muted' }, when(b.created_at)),
                // Each earlier succeeded deploy can be rolled back to; the
                // action's reason says why not when it cannot now.
                el(
                  'td',
                  {},
                  b.kind === 'deploy' && b.status === 'succeeded' && b.id !== deployedId && rollback
                    ? el('button', { type: 'button', 'data-rollback': b.id, disabled: !rollback.enabled, title: rollback.reason || `deploy this build's configuration and source again`, onclick: () => rollbackTo(b.id) }, 'Roll back')
                    : '',
                ),
              ),
            ),
          ),
        ),
      ),
      el('h2', {}, 'Audit'),
      d.audit.length === 0
        ? el('p', { class: 'muted' }, 'No events.')
        : el(
            'div',
            { class: 'scroll' },
            el(
              'table',
              {},
              el('tbody', {}, d.audit.map((e) => el('tr', {}, el('td', { class: 'muted' }, when(e.at)), el('td', {}, e.action), el('td', {}, e.result), el('td', { class: 'hide-narrow' }, e.actor ? e.actor.subject : 'berth')))),
            ),
          ),
      el('h2', {}, 'Configuration'),
      el('pre', { class: 'json' }, JSON.stringify(d.configuration, null, 2)),
    );
  };
  await render();
  // Changes appear without a reload; bursts are read once.
  const again = () => {
    if (pending) return;
    pending = setTimeout(() => {
      pending = null;
      render().catch((e) => (e instanceof Unauthorized ? refused() : null));
    }, 100);
  };
  follow(`${path}/events`, { deployment: again, build: again, sbom: again, rollout: again, node: again, 'node.drifted': again, resync_required: again });
}

// Nodes bound to agents: desired against actual, each agent's status, and
// a drifted node marked (agents.md "Desired vs actual").
function nodesSection(nodes) {
  const short = (a) => (!a ? '—' : a.digest ? a.digest.slice(7, 19) : a.path ? a.path.replace('/nix/store/', '').replace(/^[^-]*-/, '') : '—');
  return el(
    'section',
    { class: 'nodes' },
    el('h2', {}, 'Nodes'),
    el(
      'div',
      { class: 'scroll' },
      el(
        'table',
        {},
        el('thead', {}, el('tr', {}, el('th', {}, 'Node'), el('th', {}, 'Agent'), el('th', {}, 'Desired'), el('th', {}, 'Running'), el('th', { class: 'hide-narrow' }, 'Booted'), el('th', {}, 'Drift'), el('th', { class: 'hide-narrow' }, 'Last seen'))),
        el(
          'tbody',
          {},
          nodes.map((n) =>
            el(
              'tr',
              { 'data-node': n.name, 'data-agent': n.agent ? n.agent.status : 'unbound', ...(n.drift ? { 'data-drift': n.drift.what.join(' ') } : {}) },
              el('td', {}, n.name),
              el('td', {}, n.agent ? badge(n.agent.status) : '—', n.agent && n.agent.duplicate ? ' (two agents)' : ''),
              el('td', {}, short(n.desired && n.desired.artifact), n.activation && !['confirmed', 'ended', 'failed', 'lost'].includes(n.activation.status) ? ` (${n.activation.status})` : ''),
              el('td', {}, short(n.actual && n.actual.running)),
              el('td', { class: 'hide-narrow' }, short(n.actual && n.actual.booted)),
              el('td', {}, n.drift ? el('span', { class: 'drift', title: `since ${when(n.drift.since)}` }, `drifted: ${n.drift.what.join(', ')}`) : 'no'),
              el('td', { class: 'hide-narrow muted' }, n.agent && n.agent.last_seen_at ? when(n.agent.last_seen_at) : '—'),
            ),
          ),
        ),
      ),
    ),
  );
}

// A rollout: where it is, and each wave with its nodes and their state
// (pending, activated, not activated, back); the pause, resume and abort
// buttons are the actions above, each with its reason when disabled.
function rolloutSection(summary, full) {
  const held = summary.paused
    ? ` — paused by ${summary.paused.by}${summary.paused.reason ? ': ' + summary.paused.reason : ''}`
    : summary.wait_until
      ? ` — waiting until ${when(summary.wait_until)}`
      : '';
  const waves = full ? full.waves : [];
  const nodeState = (w, n) => {
    if (w.state === 'reverted') return 'back';
    if (!(n in w.activated)) return 'pending';
    return w.activated[n] ? 'activated' : 'not activated';
  };
  return el(
    'section',
    { class: 'rollout' },
    el('h2', {}, 'Rollout'),
    el(
      'p',
      { 'data-rollout': summary.state },
      `${summary.state}: wave ${summary.wave} of ${summary.wave_count}, ${summary.nodes_activated}/${summary.nodes_total} nodes activated, ${summary.unhealthy_count} unhealthy`,
      held,
      summary.abort ? ` — aborted by ${summary.abort.by}${summary.abort.reason ? ': ' + summary.abort.reason : ''}` : '',
      summary.result ? ` — ${summary.result}` : '',
    ),
    el(
      'ol',
      { class: 'waves' },
      waves.map((w) => el('li', { 'data-wave-state': w.state }, `${w.state}: `, w.nodes.map((n) => el('span', { class: 'node', 'data-node-state': nodeState(w, n) }, n, ' ')))),
    ),
  );
}

async function buildView(id) {
  let gone = false;
  cleanup.push(() => (gone = true));
  const res = await api('GET', `/v1/builds/${encodeURIComponent(id)}`);
  if (gone) return;
  if (!res.ok) return show(problem(res));
  const b = res.data;
  const status = el('span', {}, badge(b.status));
  const note = el('div', { 'aria-live': 'polite' });
  const log = el('pre', { class: 'log', id: 'log', 'data-build': id, tabindex: '0', 'aria-label': 'build log' });
  // The health step's answers, newest last (lifecycle.md "Health checks").
  const health = el('ul', { class: 'health', id: 'health', 'aria-live': 'polite' });
  let lastHealth = 0;
  const cancel = el(
    'button',
    {
      type: 'button',
      class: 'danger',
      disabled: ['succeeded', 'failed', 'cancelled'].includes(b.status),
      onclick: async () => {
        const r = await api('POST', `/v1/builds/${id}/cancel`, { headers: { 'Idempotency-Key': newKey() } });
        if (!r.ok) note.replaceChildren(problem(r));
      },
    },
    'Cancel',
  );
  show(
    el('h1', {}, 'Build ', el('code', {}, id)),
    el(
      'p',
      {},
      el('a', { href: `#/d/${encodeURIComponent(b.deployment)}` }, b.deployment),
      ' · ',
      b.kind,
      b.rollback_of ? [' · rollback to ', el('a', { href: `#/b/${b.rollback_of}`, 'data-rollback-of': b.rollback_of }, b.rollback_of.slice(0, 13) + '…')] : '',
      // Which worker runs it (workers.md "What berth shows").
      b.worker ? [' · on ', el('span', { 'data-worker': b.worker, title: b.attempt ? `attempt ${b.attempt.attempt_id}, fence ${b.attempt.fence}, ${b.attempt.state}` : '' }, b.worker === 'local' ? 'this machine' : `worker ${b.worker}`)] : '',
      ' · ',
      status,
      ' ',
      cancel,
    ),
    note,
    health,
    log,
  );
  // Lines are batched per frame: a 100,000-line log stays responsive.
  let buffer = [];
  let scheduled = false;
  let lastSeq = 0;
  // The build ended: the log is complete once the buffer is drawn.
  let ended = false;
  const flush = () => {
    scheduled = false;
    const take = buffer.splice(0, MAX_LINES_PER_FRAME);
    if (take.length === 0) {
      if (ended) log.dataset.ended = 'true';
      return;
    }
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    // One block per batch: the browser lays out and paints only the
    // blocks in view (content-visibility), however long the log grows.
    log.append(el('span', { class: 'chunk' }, take.join('\n') + '\n'));
    log.dataset.lines = String(Number(log.dataset.lines || 0) + take.length);
    if (atBottom) log.scrollTop = log.scrollHeight;
    if (buffer.length) schedule();
    else if (ended) log.dataset.ended = 'true';
  };
  const schedule = () => {
    if (!scheduled) {
      scheduled = true;
      requestAnimationFrame(flush);
    }
  };
  // The log so far in one request, then the channel from the event the
  // body covers: a long log is a text to split, not 100,000 events.
  const sofar = await logSoFar(id);
  if (gone) return;
  let cursor = null;
  if (sofar && sofar.cursor !== null) {
    const lines = sofar.text.split('\n');
    if (lines[lines.length - 1] === '') lines.pop();
    buffer = buffer.concat(lines);
    lastSeq = Number(sofar.cursor);
    cursor = sofar.cursor;
    schedule();
  }
  follow(`/v1/builds/${id}/events`, {
    log: (ev) => {
      // At least once on the wire, exactly once on the page.
      const seq = Number(ev.lastEventId);
      if (seq <= lastSeq) return;
      lastSeq = seq;
      buffer.push(ev.data);
      schedule();
    },
    health: (ev) => {
      const seq = Number(ev.lastEventId);
      if (seq <= lastHealth) return;
      lastHealth = seq;
      lastSeq = Math.max(lastSeq, seq);
      const h = JSON.parse(ev.data);
      health.append(
        el('li', { 'data-node': h.node, 'data-healthy': String(h.healthy) }, badge(h.healthy ? 'healthy' : 'unhealthy'), ` ${h.node} (check ${h.attempt})`, h.reason ? `: ${h.reason}` : ''),
      );
    },
    status: (ev) => {
      lastSeq = Math.max(lastSeq, Number(ev.lastEventId));
      status.replaceChildren(badge(JSON.parse(ev.data).status));
    },
    resync_required: () => {
      // The build channel then starts again from its first event: the
      // view starts again with it.
      note.replaceChildren(el('p', { class: 'notice' }, 'Resynchronised: the log is read again from its start.'));
      buffer = [];
      log.replaceChildren();
      log.dataset.lines = '0';
      lastSeq = 0;
    },
    end: (ev, stop) => {
      stop();
      const summary = JSON.parse(ev.data);
      status.replaceChildren(badge(summary.status));
      cancel.disabled = true;
      ended = true;
      flush();
    },
  }, { cursor });
}

/** A build's log so far and the event its body covers, or null. */
async function logSoFar(id) {
  const r = await fetch(`/v1/builds/${encodeURIComponent(id)}/log`, { headers: { Authorization: `Bearer ${token()}` } });
  if (r.status === 401) throw new Unauthorized();
  if (!r.ok) return null;
  return { text: await r.text(), cursor: r.headers.get('Berth-Event-Cursor') };
}

// Webhook subscriptions and their recent deliveries, read-only
// (notifications.md; subscribing is the API's, with the service token).
async function webhooksView() {
  let gone = false;
  cleanup.push(() => (gone = true));
  const res = await api('GET', '/v1/webhooks');
  if (gone) return;
  if (!res.ok) return show(problem(res));
  const subs = res.data.items;
  const pages = await Promise.all(subs.map((w) => api('GET', `/v1/webhooks/${w.id}/deliveries?limit=5`)));
  if (gone) return;
  show(
    el('h1', {}, 'Webhooks'),
    el(
      'div',
      {},
      subs.length === 0
      ? el('p', { class: 'muted' }, 'No subscriptions. POST /v1/webhooks with the service token makes one.')
      : subs.map((w, i) =>
          el(
            'section',
            { 'data-webhook': w.id },
            el('h2', {}, w.url),
            el('p', { class: 'muted' }, `${w.events.join(', ')} · ${w.deployments ? w.deployments.join(', ') : 'every deployment'}${w.description ? ' · ' + w.description : ''}`),
            el(
              'div',
              { class: 'scroll' },
              el(
                'table',
                {},
                el('thead', {}, el('tr', {}, el('th', {}, 'Event'), el('th', {}, 'Status'), el('th', {}, 'Attempts'), el('th', { class: 'hide-narrow' }, 'Last error'), el('th', { class: 'hide-narrow' }, 'Created'))),
                el(
                  'tbody',
                  {},
                  (pages[i].ok ? pages[i].data.items : []).map((d) =>
                    el(
                      'tr',
                      { 'data-delivery': d.id },
                      el('td', {}, d.event_type),
                      el('td', {}, badge(d.status)),
                      el('td', {}, String(d.attempts)),
                      el('td', { class: 'hide-narrow' }, d.last_error || (d.last_status_code ? String(d.last_status_code) : '—')),
                      el('td', { class: 'hide-narrow muted' }, when(d.created_at)),
                    ),
                  ),
                ),
              ),
            ),
          ),
        ),
    ),
  );
}

async function submitView(id) {
  let current = null;
  if (id) {
    const r = await api('GET', `/v1/deployments/${encodeURIComponent(id)}`);
    if (r.ok) current = r.data.configuration;
  }
  const idInput = el('input', { id: 'deployment', value: id, required: true, pattern: '[a-z0-9]([a-z0-9\\-]{0,38}[a-z0-9])?', autocomplete: 'off' });
  const editor = el('textarea', { id: 'configuration', spellcheck: 'false' });
  editor.value = JSON.stringify(current || { domain: 'example.org', applications: {} }, null, 2);
  const out = el('div', { id: 'result', 'aria-live': 'polite' });
  // One key per configuration text: a retried submit is not a second build.
  let key = newKey();
  let keyFor = null;
  const body = () => {
    try {
      return { configuration: JSON.parse(editor.value) };
    } catch (e) {
      out.replaceChildren(el('div', { class: 'errors', role: 'alert' }, 'Not JSON: ', e.message));
      return null;
    }
  };
  const send = async (what) => {
    const b = body();
    if (!b) return;
    const name = idInput.value.trim();
    if (!idInput.checkValidity()) {
      out.replaceChildren(el('div', { class: 'errors', role: 'alert' }, 'A deployment id is a lower-case DNS label (a-z, 0-9, -; up to 40).'));
      return;
    }
    if (keyFor !== name + editor.value) {
      key = newKey();
      keyFor = name + editor.value;
    }
    const headers = what === 'submit' ? { 'Idempotency-Key': key } : {};
    const r = await api('POST', `/v1/deployments/${encodeURIComponent(name)}/${what}`, { body: b, headers });
    if (!r.ok) return out.replaceChildren(problem(r));
    if (what === 'preview') {
      return out.replaceChildren(el('h2', {}, 'Preview'), el('pre', { class: 'json' }, JSON.stringify(r.data, null, 2)));
    }
    location.hash = `#/b/${r.data.build_id}`;
  };
  show(
    el('h1', {}, id ? `Change ${id}` : 'Submit a configuration'),
    el(
      'form',
      { onsubmit: (e) => (e.preventDefault(), send('submit')) },
      el('label', { for: 'deployment' }, 'Deployment id'),
      idInput,
      el('label', { for: 'configuration' }, 'Configuration (JSON)'),
      editor,
      el(
        'div',
        { class: 'row' },
        el('button', { type: 'button', onclick: () => send('preview') }, 'Preview'),
        el('button', { type: 'submit', class: 'primary' }, 'Submit'),
      ),
    ),
    out,
  );
}
