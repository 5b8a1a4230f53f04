// Package remote carries a backend.Controller across processes: Handler
// serves one over HTTP, Client is one that calls such a server. It is how
// the controller reaches a zone's storage target (the same binary in role
// target, which owns the zone's pool on its own disk and keeps the
// volumes' records next to their images), so the controller shares no
// directory with the targets and may run in any zone.
//
// # Wire
//
// Every method is a POST of a JSON body to /v1/<Method>; the answer is a
// JSON envelope holding either the result or an error with its gRPC code
// and message, so that a target's NOT_FOUND or RESOURCE_EXHAUSTED reaches
// the CO unchanged. A target that cannot be reached is UNAVAILABLE, and so
// is a method the target does not serve (one of an older version): a call
// it cannot answer is waited for, never taken for a "no".
//
// # Authentication
//
// Across hosts the API is served over TLS with client certificates
// required (mutual TLS, TLSFiles): the target accepts a client whose
// certificate its CA signed for client authentication, and the
// controller accepts a target whose certificate the same CA signed for the
// name it dialled. The files are read again at every new connection, so a
// rotated Secret takes effect without a restart. On one host a unix
// socket (mode 0600, root only) serves instead.
package remote

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// maxRequest bounds a request body: the largest is a CreateVolume's spec
// or an attachment list, far below it.
const maxRequest = 1 << 20

// maxResponse bounds an answer the client reads: a ListVolumes of a large
// pool is the largest.
const maxResponse = 256 << 20

// envelope is every answer: the method's result or its error.
type envelope struct {
	Result json.RawMessage `json:"result,omitempty"`
	Error  *wireError      `json:"error,omitempty"`
}

type wireError struct {
	Code    codes.Code `json:"code"`
	Message string     `json:"message"`
}

// toWire keeps a status error's code; any other error is UNKNOWN with its
// text, as gRPC would send it.
func toWire(err error) *wireError {
	s := status.Convert(err)
	return &wireError{Code: s.Code(), Message: s.Message()}
}

// handle registers fn as method: the request body decoded into Req, the
// answer fn's result or error.
func handle[Req, Resp any](mux *http.ServeMux, method string, fn func(context.Context, Req) (Resp, error)) {
	mux.HandleFunc("POST /v1/"+method, func(w http.ResponseWriter, r *http.Request) {
		var req Req
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxRequest))
		dec.DisallowUnknownFields()
		var env envelope
		if err := dec.Decode(&req); err != nil {
			env.Error = &wireError{Code: codes.InvalidArgument, Message: fmt.Sprintf("%s: the request is not what the target takes: %v", method, err)}
		} else if resp, err := fn(r.Context(), req); err != nil {
			env.Error = toWire(termEnded(r.Context(), err))
		} else if env.Result, err = json.Marshal(resp); err != nil {
			env.Error = &wireError{Code: codes.Internal, Message: fmt.Sprintf("%s: encoding the answer: %v", method, err)}
		}
		writeEnvelope(w, env)
	})
}

func writeEnvelope(w http.ResponseWriter, env envelope) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(env)
}

// call posts req to method at the client's target and decodes the result
// into a Resp.
//
// A holder refused for want of the lease (its term ran out between two
// renewals that did not get through in time, or ended while the call ran)
// takes the lease again at once and calls again, rather than failing the
// call until the next renewal: the refused call was not carried out (or was
// cancelled, and calls are idempotent), and Acquire refuses while another
// controller holds the lease, so a controller that lost it to a successor
// is still refused.
func call[Resp, Req any](ctx context.Context, c *Client, method string, req Req) (Resp, error) {
	resp, err := callOnce[Resp](ctx, c, method, req)
	if err == nil || c.holder == "" || c.termEpoch != nil || method == "Info" {
		return resp, err
	}
	if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.HasPrefix(st.Message(), notTheHolder) {
		return resp, err
	}
	if aerr := c.acquire(ctx); aerr != nil {
		return resp, err
	}
	return callOnce[Resp](ctx, c, method, req)
}

// callOnce is one call of method, its answer decoded into Resp.
func callOnce[Resp, Req any](ctx context.Context, c *Client, method string, req Req) (Resp, error) {
	var resp Resp
	body, err := json.Marshal(req)
	if err != nil {
		return resp, status.Errorf(codes.Internal, "%s: encoding the request: %v", method, err)
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/v1/"+method, bytes.NewReader(body))
	if err != nil {
		return resp, status.Errorf(codes.Internal, "%s: %v", method, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	if c.holder != "" {
		hreq.Header.Set(holderHeader, c.holder)
		epoch := c.epoch.Load()
		if c.termEpoch != nil && !unleased[method] {
			// Refused here rather than by the target: a controller whose
			// term it counts ended must not send, since its own count
			// ends before the target's.
			if epoch, err = c.termEpoch(c.name); err != nil {
				return resp, status.Errorf(codes.Unavailable, "%s to storage target %s not sent: %v", method, c.name, err)
			}
		}
		if c.info.LeaseVersion >= leaseVersion {
			hreq.Header.Set(epochHeader, strconv.FormatUint(epoch, 10))
		}
	}
	hresp, err := c.http.Do(hreq)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return resp, status.FromContextError(ctxErr).Err()
		}
		return resp, status.Errorf(codes.Unavailable, "storage target %s: %v", c.name, err)
	}
	defer hresp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(hresp.Body, maxResponse))
	if err != nil {
		return resp, status.Errorf(codes.Unavailable, "storage target %s: %s: reading the answer: %v", c.name, method, err)
	}
	if hresp.StatusCode == http.StatusNotFound {
		// The API's paths are its methods: a target of an older version
		// than the controller's lacks the newer ones, and is waited for
		// like a target that is down.
		return resp, status.Errorf(codes.Unavailable, "storage target %s does not serve %s (%s), as a target older than this controller does not; upgrade it",
			c.name, method, bytes.TrimSpace(data))
	}
	if hresp.StatusCode != http.StatusOK {
		return resp, status.Errorf(codes.Unavailable, "storage target %s: %s: %s: %s", c.name, method, hresp.Status, bytes.TrimSpace(data))
	}
	var env envelope
	if err := json.Unmarshal(data, &env); err != nil {
		return resp, status.Errorf(codes.Unavailable, "storage target %s: %s: the answer is not the API's: %v", c.name, method, err)
	}
	if env.Error != nil {
		return resp, status.Error(env.Error.Code, env.Error.Message)
	}
	if len(env.Result) == 0 {
		return resp, status.Errorf(codes.Unavailable, "storage target %s: %s: an answer with neither result nor error", c.name, method)
	}
	if err := json.Unmarshal(env.Result, &resp); err != nil {
		return resp, status.Errorf(codes.Unavailable, "storage target %s: %s: decoding the result: %v", c.name, method, err)
	}
	return resp, nil
}

// errNoTLS is a TLS configuration missing one of its files.
var errNoTLS = errors.New("mutual TLS needs a certificate, its key and the CA that signs the peers")
