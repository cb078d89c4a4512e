-- wrk script for the submit benchmark: every request submits a new
-- deployment with its own idempotency key, or, with
-- BERTH_BENCH_DEPLOYMENTS=N, one of N deployments in turn (a fleet that
-- keeps deploying; each submit still has its own key and configuration).
-- BERTH_TOKEN comes from the environment. Prints one JSON line at the end.
local token = os.getenv("BERTH_TOKEN")
local fleet = tonumber(os.getenv("BERTH_BENCH_DEPLOYMENTS") or "0")
local threads = {}
local counter = 0
local prefix = ""

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

-- Every run's idempotency keys (and, without a fleet, deployment ids) are
-- new: math.random is not seeded, so the same prefix in a later run (or
-- phase) would replay earlier submits by their keys (fast reads, not
-- submits) and inflate the rate.
local function random_hex(bytes)
  local f = assert(io.open("/dev/urandom", "rb"))
  local raw = f:read(bytes)
  f:close()
  return (raw:gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

function init(args)
  prefix = string.format("w%dr%s", tid, random_hex(8))
end

function request()
  counter = counter + 1
  local key = string.format("%sn%d", prefix, counter)
  local id = key
  if fleet > 0 then
    id = string.format("fleet%d", (counter * 7 + tid) % fleet)
  end
  local body = '{"configuration":{"domain":"' .. key .. '.example.org"},"mode":"enqueue"}'
  return wrk.format("POST", "/v1/deployments/" .. id .. "/submit", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "bench-" .. key,
  }, body)
end

function done(summary, latency, requests)
  local failed = summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout
  io.write(string.format(
    '{"requests":%d,"seconds":%.3f,"failed":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration / 1e6, failed,
    latency:percentile(50), latency:percentile(99)))
end
