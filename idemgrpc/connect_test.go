package idemgrpc_test

import (
	"bytes"
	"compress/gzip"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
)

// connectPost is a unary Connect call of path with body.
func connectPost(path, contentType, encoding string, body []byte) *http.Request {
	r := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
	r.Header.Set("Content-Type", contentType)
	r.Header.Set("Connect-Protocol-Version", "1")
	if encoding != "" {
		r.Header.Set("Content-Encoding", encoding)
	}
	return r
}

func gzipped(t *testing.T, b []byte) []byte {
	t.Helper()
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	if _, err := zw.Write(b); err != nil || zw.Close() != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

func TestConnectFingerprintReadsTheMessageNotItsBytes(t *testing.T) {
	t.Parallel()
	part := func(m *testpb.PayRequest) []byte {
		b, _ := proto.Marshal(m)
		return b
	}
	amount, a, b := part(&testpb.PayRequest{AmountCents: 5}), part(&testpb.PayRequest{Labels: map[string]string{"a": "1"}}),
		part(&testpb.PayRequest{Labels: map[string]string{"b": "2"}})
	abOrder, baOrder := bytes.Join([][]byte{amount, a, b}, nil), bytes.Join([][]byte{amount, b, a}, nil)
	other := part(&testpb.PayRequest{AmountCents: 6})
	fp := func(r *http.Request, body []byte) string {
		t.Helper()
		got, err := idemgrpc.ConnectFingerprint(r, body)
		if err != nil {
			t.Fatal(err)
		}
		return string(got)
	}
	const pay = "/idemgrpc.test.v1.Payments/Pay"
	proto1 := fp(connectPost(pay, "application/proto", "", abOrder), abOrder)
	for name, got := range map[string]string{
		"map entries in another order": fp(connectPost(pay, "application/proto", "", baOrder), baOrder),
		"gzipped":                      fp(connectPost(pay, "application/proto", "gzip", nil), gzipped(t, baOrder)),
	} {
		if got != proto1 {
			t.Errorf("%s: the fingerprint differs", name)
		}
	}
	json1 := fp(connectPost(pay, "application/json", "", []byte(`{"amountCents":"5","labels":{"a":"1","b":"2"}}`)), []byte(`{"amountCents":"5","labels":{"a":"1","b":"2"}}`))
	json2body := []byte(`{"labels": {"b": "2", "a": "1"}, "amount_cents": 5}`)
	if json2 := fp(connectPost(pay, "application/json; charset=utf-8", "", json2body), json2body); json2 != json1 {
		t.Error("the same message in JSON spelled another way: the fingerprint differs")
	}
	for name, got := range map[string]string{
		"JSON rather than binary": json1,
		"another message":         fp(connectPost(pay, "application/proto", "", other), other),
	} {
		if got == proto1 {
			t.Errorf("%s: the same fingerprint", name)
		}
	}
}

func TestConnectFingerprintRefusesWhatItCannotRead(t *testing.T) {
	t.Parallel()
	body, _ := proto.Marshal(&testpb.PayRequest{AmountCents: 5})
	bomb := gzipped(t, make([]byte, 4<<20+1))
	for name, tc := range map[string]struct {
		r    *http.Request
		body []byte
		says string
	}{
		"GET":             {httptest.NewRequest(http.MethodGet, "/idemgrpc.test.v1.Payments/Pay", nil), nil, "cover POST only"},
		"unknown service": {connectPost("/no.Such/Pay", "application/proto", "", body), body, "not in protobuf's global registry"},
		"unknown method":  {connectPost("/idemgrpc.test.v1.Payments/Refund", "application/proto", "", body), body, "has no method Refund"},
		"short path":      {connectPost("/Pay", "application/proto", "", body), body, "does not end in"},
		"gRPC":            {connectPost("/idemgrpc.test.v1.Payments/Pay", "application/grpc", "", body), body, "not a unary Connect codec"},
		"bad body":        {connectPost("/idemgrpc.test.v1.Payments/Pay", "application/proto", "", nil), []byte{0xff}, "decode a idemgrpc.test.v1.PayRequest"},
		"brotli":          {connectPost("/idemgrpc.test.v1.Payments/Pay", "application/proto", "br", nil), body, `compressed with "br"`},
		"gzip bomb":       {connectPost("/idemgrpc.test.v1.Payments/Pay", "application/proto", "gzip", nil), bomb, "more than 4194304 bytes"},
	} {
		if _, err := idemgrpc.ConnectFingerprint(tc.r, tc.body); err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v; want an error that says %q", name, err, tc.says)
		}
	}
}
